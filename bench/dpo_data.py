"""Preference records and a tokenizer for bench/dpo_pairs.sh: the word-level tokenizer of hack/tinyhf.py (one
token per word) written into a model directory, and records of plain-text prompts and two answers of random
words whose every row (prompt and answer, with the end-of-sequence token) is exactly SEQ + 1 tokens: each side
trains SEQ positions per row with no padding.

    python bench/dpo_data.py MODEL_DIR RECORDS_OUT [COUNT] [SEQ]"""

import json
import random
import sys
from pathlib import Path

from tinyhf import WORDS, write_tokenizer

model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
count = int(sys.argv[3]) if len(sys.argv) > 3 else 2000
seq = int(sys.argv[4]) if len(sys.argv) > 4 else 2048
write_tokenizer(model_dir)
rng = random.Random(0)
prompt_words, answer_words = seq // 2, seq - seq // 2  # + the end-of-sequence token: seq + 1 tokens a row


def words(n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


with open(out, "w") as f:
    for _ in range(count):
        f.write(json.dumps({"prompt": words(prompt_words), "chosen": " " + words(answer_words),
                            "rejected": " " + words(answer_words)}) + "\n")  # fmt: skip
