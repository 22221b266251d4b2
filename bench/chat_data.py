"""A chat dataset for the data-pipeline benchmark (bench/hf_pairs.sh's `-chat` arms): a real tokenizer and
records of real text, of varied length.

    python bench/chat_data.py --sp-model PATH --out DIR [--records N]

The tokenizer is Mistral 7B's SentencePiece model (`tokenizer.model.v1` in the mistral-common wheel, 32,000
tokens), converted by transformers to its fast tokenizer (the conversion needs `sentencepiece` and
`protobuf`; reading the saved directory does not) and given a ChatML template, so it renders a
conversation turn by turn as the trainer's response-only loss needs. The records are conversations about
the functions and classes of Python's standard library: a user asks what one does, the assistant answers
with its docstring; every fifth opens with a system turn and every third has a follow-up turn, so records
run from tens to thousands of tokens. Output: DIR/tokenizer/ and DIR/chat.jsonl.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
from pathlib import Path

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def documented(root: Path) -> list[tuple[str, str, str]]:
    """(module, name, docstring) for every function and class with a docstring of 200 characters or more."""
    out = []
    for path in sorted(root.rglob("*.py")):
        if {"test", "idlelib", "site-packages", "dist-packages"} & set(path.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200:
                    out.append((module, node.name, doc))
    return out


def records(docs: list[tuple[str, str, str]], count: int, seed: int = 0):
    rng = random.Random(seed)
    for n in range(count):
        module, name, doc = docs[rng.randrange(len(docs))]
        messages = [{"role": "system", "content": "You answer questions about Python's standard library."}] * (
            n % 5 == 0)  # fmt: skip
        messages += [{"role": "user", "content": f"What does `{name}` in `{module}` do?"},
                     {"role": "assistant", "content": doc}]  # fmt: skip
        if n % 3 == 0:
            module2, name2, doc2 = docs[rng.randrange(len(docs))]
            messages += [{"role": "user", "content": f"And `{name2}` in `{module2}`?"},
                         {"role": "assistant", "content": doc2}]  # fmt: skip
        yield {"messages": messages}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp-model", type=Path, required=True, help="a SentencePiece tokenizer.model")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--records", type=int, default=20_000)
    a = p.parse_args()
    import shutil
    import tempfile

    from transformers import LlamaTokenizer

    with tempfile.TemporaryDirectory() as spdir:
        shutil.copy(a.sp_model, Path(spdir) / "tokenizer.model")
        tokenizer = LlamaTokenizer.from_pretrained(spdir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(str(a.out / "tokenizer"))
    docs = documented(Path(sysconfig.get_paths()["stdlib"]))
    with open(a.out / "chat.jsonl", "w", encoding="utf-8") as f:
        for record in records(docs, a.records):
            f.write(json.dumps(record) + "\n")
    print(f"wrote {a.out}: a {len(tokenizer)}-token tokenizer, {a.records} records from {len(docs)} docstrings")


if __name__ == "__main__":
    main()
