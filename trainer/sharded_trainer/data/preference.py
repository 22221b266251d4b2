"""Preference records (a prompt, a chosen and a rejected answer) tokenized once into a cache, then served as
pairs of rows: the chosen answer's row and the rejected answer's, trained in one forward pass.

A record is `prompt` (a string, or a list of chat messages) or `messages` (the conversation before the
answers), plus `chosen` and `rejected`: each a string, an assistant message, or a list holding one. Chat
prompts are rendered with the tokenizer's chat template, the answer as the assistant's next turn; text
prompts are joined to the answer as they are. Only the answer's tokens carry log-probabilities.

The cache does not depend on the sequence length: a pair longer than `seqLen` is cut when it is read, the
prompt first (its oldest tokens), then the answers' ends. Each row is one sequence, padded; nothing is packed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from sharded_api.config import DataConfig
from sharded_trainer.data import records
from sharded_trainer.data.records import DataError
from sharded_trainer.data.sources import IGNORE, _mix

CACHE_VERSION = 1


def _answer(record: dict, key: str) -> tuple[str | None, str]:
    """The answer's text, or None with the reason it cannot be trained on."""
    value = record.get(key)
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, dict):
        if value.get("role") != "assistant":
            return None, f"`{key}` as a message must be the assistant's"
        value = value.get("content")
    if not isinstance(value, str):
        what = "missing" if value is None else f"a {type(value).__name__}"
        return None, f"`{key}` is {what}: give the answer as a string or one assistant message"
    if not value.strip():
        return None, f"`{key}` is empty"
    return value, ""


def _prompt(record: dict) -> tuple[str | list | None, str]:
    """The prompt, or None with the reason it cannot be used."""
    prompt = record["prompt"] if "prompt" in record else record.get("messages")
    if isinstance(prompt, str):
        return prompt, ""
    if isinstance(prompt, list) and prompt:
        for m in prompt:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                return None, "every message of the prompt needs a `role` and a `content` string"
        return prompt, ""
    return (
        None,
        f"a preference record needs `prompt` (a string or chat messages) or `messages`, got keys {sorted(record)}",
    )


def render(tokenizer, where: str, prompt: str | list, answer: str) -> tuple[list[int], int]:
    """(token ids of prompt and answer, how many of them are the prompt's). The answer is told apart by
    character offsets: a token that overlaps the answer belongs to it (a byte-level BPE merges the space
    before an answer into the answer's first token)."""
    if isinstance(prompt, str):
        text, start = prompt + answer, len(prompt)
        enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
        if tokenizer.eos_token_id is not None:  # the model learns where the answer ends
            ids.append(tokenizer.eos_token_id)
            offsets.append((len(text), len(text) + 1))
    else:
        if not tokenizer.chat_template:
            raise DataError(f"{where}: chat prompts need a tokenizer with a chat template (tokenizer_config.json)")
        before = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        text = tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": answer}], tokenize=False)
        if not text.startswith(before):
            raise DataError(f"{where}: the chat template does not render the answer after the prompt, so the "
                            "answer's tokens cannot be told apart")  # fmt: skip
        start = len(before)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    prompt_len = next((i for i, (_, end) in enumerate(offsets) if end > start), len(ids))
    return ids, prompt_len


def tokenize_pair(tokenizer, where: str, record: dict) -> tuple[list[int], int, list[int], int] | str:
    """(chosen ids, its prompt length, rejected ids, its prompt length), or why the record cannot be used."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a preference record is a JSON object, got {type(record).__name__}")
    prompt, why = _prompt(record)
    if prompt is None:
        return why
    chosen, why = _answer(record, "chosen")
    if chosen is None:
        return why
    rejected, why = _answer(record, "rejected")
    if rejected is None:
        return why
    if chosen == rejected:
        return "`chosen` and `rejected` are the same answer: there is no preference to learn"
    c_ids, c_prompt = render(tokenizer, where, prompt, chosen)
    r_ids, r_prompt = render(tokenizer, where, prompt, rejected)
    if c_prompt == len(c_ids) or r_prompt == len(r_ids):
        return "an answer renders to no tokens of its own"
    return c_ids, c_prompt, r_ids, r_prompt


def cache_key(cfg: DataConfig, tokenizer_dir: str) -> str:
    """The SFT cache's inputs, and that the records are pairs (the two caches never share a directory)."""
    base = records.cache_key(cfg, tokenizer_dir)
    parts = {"version": CACHE_VERSION, "records": base, "skipBadRecords": cfg.skip_bad_records}
    return "dpo-" + hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def build_cache(cfg: DataConfig, tokenizer_dir: str, directory: Path) -> dict:
    """Tokenize every pair into `directory` (records.write_cache). Rows 2i and 2i+1 are record i's chosen and
    rejected answers; `prompts` holds each row's prompt length."""
    tokenizer = records.load_tokenizer(tokenizer_dir)
    tokens: list[int] = []
    offsets, prompts, split, skipped = [0], [], [], []
    for n, (where, record) in enumerate(records.read_records(cfg)):
        pair = tokenize_pair(tokenizer, where, record)
        if isinstance(pair, str):
            if not cfg.skip_bad_records:
                raise DataError(f"{where}: {pair}; fix or remove the record, or set data.skipBadRecords to skip "
                                "and count such records")  # fmt: skip
            skipped.append(where)
            continue
        c_ids, c_prompt, r_ids, r_prompt = pair
        for ids, prompt_len in ((c_ids, c_prompt), (r_ids, r_prompt)):
            tokens += ids
            offsets.append(len(tokens))
            prompts.append(prompt_len)
        held = cfg.eval_fraction > 0 and int(_mix(n, cfg.seed + 1) % np.uint64(1_000_000)) < cfg.eval_fraction * 1e6
        split.append(1 if held else 0)
    if not split:
        raise DataError(f"data.path {cfg.path}: no usable preference records" + (
            f" ({len(skipped)} skipped, the first at {skipped[0]})" if skipped else ""))  # fmt: skip
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    meta = {
        "records": len(split), "skipped": len(skipped), "firstSkipped": skipped[0] if skipped else None,
        "tokens": len(tokens), "evalRecords": int(sum(split)), "pad": int(pad), "maxToken": max(tokens, default=0),
    }  # fmt: skip
    arrays = {"tokens": np.asarray(tokens, dtype=np.int32), "offsets": np.asarray(offsets, dtype=np.int64),
              "prompts": np.asarray(prompts, dtype=np.int64), "split": np.asarray(split, dtype=np.uint8)}  # fmt: skip
    records.write_cache(directory, arrays, meta)
    return meta


def cut(prompts: tuple[int, int], lengths: tuple[int, int], seq_len: int) -> tuple[int, int]:
    """(prompt tokens dropped from the front, answer tokens kept at most) so that both rows of a pair fit
    `seq_len` input positions. The prompt gives way first, down to half the row (or its own length when
    shorter); then the answers lose their ends. At least one answer token always stays.

    The two rows' prompts are the same tokens but perhaps the last one (a byte-level BPE may merge the
    prompt's end into the answer's first token differently): the longer one decides."""
    prompt = max(prompts)
    longest = max(n - p for n, p in zip(lengths, prompts, strict=True))
    room = seq_len + 1  # seq_len inputs predict seq_len targets: a row of L tokens needs L - 1 inputs
    if prompt + longest <= room:
        return 0, longest
    keep_prompt = max(room - longest, min(prompt, room // 2))
    return prompt - keep_prompt, room - keep_prompt


class PreferenceSource:
    """Pairs of rows (chosen, rejected) from a tokenized preference cache, with their reference
    log-probabilities when they were precomputed (`reference`: one (chosen, rejected) row per record)."""

    def __init__(self, cfg: DataConfig, directory: Path, seq_len: int, vocab_size: int, *, eval_split: bool = False):
        self.cfg, self.seq_len, self.directory = cfg, seq_len, directory
        self.meta = json.loads((directory / "meta.json").read_text())
        if self.meta["maxToken"] >= vocab_size:
            raise DataError(f"token {self.meta['maxToken']} of the tokenized data is outside the model's "
                            f"vocabulary ({vocab_size}): use the model's own tokenizer")  # fmt: skip
        self.tokens = np.load(directory / "tokens.npy", mmap_mode="r")
        self.offsets = np.load(directory / "offsets.npy")
        self.prompts = np.load(directory / "prompts.npy")
        split = np.load(directory / "split.npy")
        self.records = np.flatnonzero(split == (1 if eval_split else 0))
        if not len(self.records):
            raise DataError(f"data.path {cfg.path}: no {'held-out' if eval_split else 'training'} preference record")
        self.shuffle = not eval_split
        self.reference: np.ndarray | None = None
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.records)

    def record_of(self, index: int) -> int:
        """The record (its number in the cache) of global sample `index`: each epoch in its own order."""
        epoch, at = divmod(index, len(self))
        if not self.shuffle:
            return int(self.records[at])
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self))
        return int(self.records[self._perm[at]])

    def pair(self, record: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), each (2, seq_len): the chosen row, then the rejected one; targets are IGNORE
        but on the answers' tokens."""
        bounds = self.offsets[2 * record : 2 * record + 3]
        rows = [np.asarray(self.tokens[bounds[k] : bounds[k + 1]]) for k in (0, 1)]
        prompts = (int(self.prompts[2 * record]), int(self.prompts[2 * record + 1]))
        drop, keep = cut(prompts, (len(rows[0]), len(rows[1])), self.seq_len)
        inputs = np.full((2, self.seq_len), self.meta["pad"], dtype=np.int64)
        targets = np.full((2, self.seq_len), IGNORE, dtype=np.int64)
        for k, row in enumerate(rows):
            own_prompt = prompts[k]
            row = row[drop : own_prompt + keep]
            n = len(row) - 1
            inputs[k, :n] = row[:-1]
            targets[k, :n] = row[1:]
            targets[k, : own_prompt - drop - 1] = IGNORE  # the prompt's tokens carry no log-probability
        return inputs, targets

    def sample(self, index: int) -> tuple[np.ndarray, ...]:
        """(inputs, targets, positions, reference) of global sample `index`: one pair; positions are None (one
        sequence per row) and reference is the pair's precomputed log-probabilities, or None."""
        record = self.record_of(index)
        inputs, targets = self.pair(record)
        reference = None if self.reference is None else self.reference[record]
        return inputs, targets, None, reference
