"""Text and chat records (jsonl, parquet, arrow) tokenized once into a cache, then packed into sequences.

The cache is keyed by what it is made from (the data files, the tokenizer, the masking switch, the eval
split), so every later start and every rank reads it instead of tokenizing again. Packing keeps records
apart: each carries its own position ids, which transformers turns into attention that stops at the
record's boundary, and targets are shifted within a record, never across two. A global sample index maps
to one packed row through a seeded per-epoch permutation, so the data position stays one number
(`ShardedLoader.consumed`) that survives restarts and changes of world size.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from sharded_api.config import DataConfig
from sharded_api.loading import ConfigError
from sharded_trainer.data.sources import IGNORE, _mix

CACHE_VERSION = 1
SUFFIXES = {"jsonl": (".jsonl", ".json"), "parquet": (".parquet",), "arrow": (".arrow",)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt")  # fmt: skip


class DataError(ConfigError):
    """A data file or record the trainer cannot use; the message names the file (and line) and the fix (a
    permanent failure: exit code 2, as an invalid config)."""


def data_files(cfg: DataConfig) -> list[Path]:
    assert cfg.path is not None
    root = Path(cfg.path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise DataError(f"data.path {cfg.path}: no such file or directory")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES[cfg.source]))
    if not files:
        raise DataError(f"data.path {cfg.path}: no {'/'.join(SUFFIXES[cfg.source])} files in the directory")
    return files


def read_records(cfg: DataConfig) -> Iterator[tuple[str, dict]]:
    """(where, record) for every record of every file, in file order."""
    for path in data_files(cfg):
        if cfg.source == "jsonl":
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield f"{path}:{n}", json.loads(line)
                        except json.JSONDecodeError as e:
                            raise DataError(f"{path}:{n}: not a JSON record ({e.msg})") from e
            continue
        import pyarrow as pa
        import pyarrow.parquet as pq

        if cfg.source == "parquet":
            table = pq.read_table(path)
        else:  # Arrow IPC: the file format, or the stream format `datasets` writes
            try:
                table = pa.ipc.open_file(path).read_all()
            except pa.ArrowInvalid:
                table = pa.ipc.open_stream(path).read_all()
        for batch in table.to_batches(max_chunksize=1024):
            for n, record in enumerate(batch.to_pylist()):
                yield f"{path}[{n}]", record


def load_tokenizer(directory: str):
    from transformers import AutoTokenizer

    if not Path(directory).is_dir():
        raise DataError(f"tokenizer directory {directory} does not exist")
    return AutoTokenizer.from_pretrained(directory)


def tokenize(tokenizer, where: str, record: dict, response_only: bool) -> tuple[list[int], list[bool]]:
    """A record's token ids and, per token, whether it is trained on (predicted with a loss)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record is a JSON object with `text` or `messages`, got {type(record).__name__}")
    if isinstance(record.get("messages"), list):
        return _chat(tokenizer, where, record["messages"], response_only)
    if isinstance(record.get("text"), str):
        ids = tokenizer(record["text"], add_special_tokens=True)["input_ids"]
        if tokenizer.eos_token_id is not None:
            ids = [*ids, tokenizer.eos_token_id]  # the model learns where a document ends
        return ids, [True] * len(ids)
    raise DataError(f"{where}: a record needs a `text` string or a `messages` list, got keys {sorted(record)}")


def _chat(tokenizer, where: str, messages: list, response_only: bool) -> tuple[list[int], list[bool]]:
    if not tokenizer.chat_template:
        raise DataError(f"{where}: chat records need a tokenizer with a chat template (tokenizer_config.json)")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: every message needs a `role` and a `content` string")
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []  # character ranges of the assistant's turns
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(before) and text.startswith(through)):
            raise DataError(f"{where}: the chat template does not render the conversation turn by turn, so the "
                            "assistant's tokens cannot be told apart: set data.responseOnlyLoss false")  # fmt: skip
        spans.append((len(before), len(through)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    if not response_only:
        return ids, [True] * len(ids)
    # A token that overlaps an answer is trained on: a byte-level BPE merges the space the template puts
    # before the answer into the answer's first token, which then starts before the answer's span.
    trained = [any(start < b and end > a for a, b in spans) for start, end in enc["offset_mapping"]]
    return ids, trained


def _fingerprint_files(paths: list[Path]) -> list:
    return [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in paths]


def cache_key(cfg: DataConfig, tokenizer_dir: str) -> str:
    """What the tokenized cache is made from: the data files (path, size, mtime), the tokenizer's files
    (contents), and the settings that change the tokens or their split."""
    tok = Path(tokenizer_dir)
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (tok / name).is_file():
            h.update(name.encode() + (tok / name).read_bytes())
    parts = {
        "version": CACHE_VERSION, "files": _fingerprint_files(data_files(cfg)), "tokenizer": h.hexdigest(),
        "source": cfg.source, "responseOnlyLoss": cfg.response_only_loss, "evalFraction": cfg.eval_fraction,
        "seed": cfg.seed,
    }  # fmt: skip
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def is_ready(directory: Path) -> bool:
    return (directory / "meta.json").is_file()


def build_cache(cfg: DataConfig, tokenizer_dir: str, directory: Path) -> dict:
    """Tokenize every record into `directory` (written aside, then renamed: readers never see half a cache)."""
    tokenizer = load_tokenizer(tokenizer_dir)
    tokens: list[int] = []
    trained: list[bool] = []
    offsets, split = [0], []
    for n, (where, record) in enumerate(read_records(cfg)):
        ids, mask = tokenize(tokenizer, where, record, cfg.response_only_loss)
        tokens += ids
        trained += mask
        offsets.append(len(tokens))
        # Held out by a hash of the record's index: the same records whatever the file boundaries.
        held = cfg.eval_fraction > 0 and int(_mix(n, cfg.seed + 1) % np.uint64(1_000_000)) < cfg.eval_fraction * 1e6
        split.append(1 if held else 0)
    if not split:
        raise DataError(f"data.path {cfg.path}: no records")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    meta = {
        "records": len(split), "tokens": len(tokens), "trainedTokens": int(sum(trained)),
        "evalRecords": int(sum(split)), "pad": int(pad), "maxToken": max(tokens, default=0),
    }  # fmt: skip
    arrays = {"tokens": np.asarray(tokens, dtype=np.int32), "trained": np.asarray(trained, dtype=np.bool_),
              "offsets": np.asarray(offsets, dtype=np.int64), "split": np.asarray(split, dtype=np.uint8)}  # fmt: skip
    write_cache(directory, arrays, meta)
    return meta


def write_cache(directory: Path, arrays: dict[str, np.ndarray], meta: dict) -> None:
    """The arrays (`name.npy`) and meta.json, written aside and renamed into `directory`: readers never see half
    a cache (is_ready looks for meta.json)."""
    aside = directory.with_name(f"{directory.name}.writing-{os.getpid()}")
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir(parents=True)
    for name, array in arrays.items():
        np.save(aside / f"{name}.npy", array)
    (aside / "meta.json").write_text(json.dumps(meta))
    try:
        os.rename(aside, directory)
    except OSError:  # another node's rank finished the same cache first: theirs is as good
        shutil.rmtree(aside, ignore_errors=True)


class RecordSource:
    """Packed rows of `seq_len` (inputs, targets, positions) from a tokenized cache."""

    def __init__(self, cfg: DataConfig, directory: Path, seq_len: int, vocab_size: int, *, eval_split: bool = False):
        self.cfg, self.seq_len = cfg, seq_len
        self.meta = json.loads((directory / "meta.json").read_text())
        if self.meta["maxToken"] >= vocab_size:
            raise DataError(f"token {self.meta['maxToken']} of the tokenized data is outside the model's "
                            f"vocabulary ({vocab_size}): use the model's own tokenizer")  # fmt: skip
        self.tokens = np.load(directory / "tokens.npy", mmap_mode="r")
        self.trained = np.load(directory / "trained.npy", mmap_mode="r")
        offsets = np.load(directory / "offsets.npy")
        split = np.load(directory / "split.npy")
        docs = np.flatnonzero(split == (1 if eval_split else 0))
        # Pieces: (first token, pairs) with at most seq_len (input, target) pairs each; a record of L tokens
        # has L - 1 pairs, a longer one is cut into several pieces.
        pieces = []
        for d in docs:
            start, pairs = int(offsets[d]), int(offsets[d + 1] - offsets[d]) - 1
            pieces += [(start + k, min(seq_len, pairs - k)) for k in range(0, max(pairs, 0), seq_len)]
        if not pieces:
            what = "held-out" if eval_split else "training"
            raise DataError(f"data.path {cfg.path}: no {what} record has two tokens or more")
        order = np.arange(len(pieces))
        if not eval_split:  # which records share a row varies with the seed, not with the world size
            order = np.random.default_rng(cfg.seed).permutation(len(pieces))
        self.pieces = np.asarray(pieces, dtype=np.int64)[order]
        self.rows = self._pack(self.pieces[:, 1]) if cfg.packing else np.arange(len(self.pieces) + 1)
        self.shuffle = not eval_split
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _pack(self, lengths: np.ndarray) -> np.ndarray:
        """Row boundaries over the pieces in order: each row takes pieces while they fit in seq_len."""
        bounds, used = [0], 0
        for i, n in enumerate(lengths.tolist()):
            if used + n > self.seq_len:
                bounds.append(i)
                used = 0
            used += n
        bounds.append(len(lengths))
        return np.asarray(bounds, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rows) - 1

    def _row_of(self, index: int) -> int:
        epoch, at = divmod(index, len(self))
        if not self.shuffle:
            return at
        if epoch != self._epoch:  # each epoch visits every row once, in its own order
            self._epoch = epoch
            self._perm = np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self))
        return int(self._perm[at])

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inputs, targets, positions) of global sample `index`, padded to seq_len."""
        row = self._row_of(index)
        inputs = np.full(self.seq_len, self.meta["pad"], dtype=np.int64)
        targets = np.full(self.seq_len, IGNORE, dtype=np.int64)
        positions = np.zeros(self.seq_len, dtype=np.int64)
        at = 0
        for start, n in self.pieces[self.rows[row] : self.rows[row + 1]].tolist():
            inputs[at : at + n] = self.tokens[start : start + n]
            nxt = self.tokens[start + 1 : start + n + 1]
            targets[at : at + n] = np.where(self.trained[start + 1 : start + n + 1], nxt, IGNORE)
            positions[at : at + n] = np.arange(n)
            at += n
        positions[at:] = np.arange(self.seq_len - at)  # padding: a record of its own, with no loss
        return inputs, targets, positions
