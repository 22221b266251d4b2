"""Token sources with deterministic, resumable per-rank sharding.

Every source maps a global sample index to one sequence, so the data position is a single number
(samples consumed) that survives restarts and changes of world size: rank r of w takes samples
`consumed + r, consumed + r + w, ...` of each global batch.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from sharded_api.config import DataConfig


def _mix(x: np.ndarray | int, seed: int) -> np.ndarray:
    """A stateless 64-bit hash (splitmix64): index -> pseudo-random, identical on every rank."""
    with np.errstate(over="ignore"):  # wrap-around is the point
        z = np.asarray(x, dtype=np.uint64) + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


# Targets with this value carry no loss (padding, prompts): the cross-entropy's ignore index.
IGNORE = -100


class Batch(NamedTuple):
    """One micro-batch: input tokens, the tokens to predict (IGNORE where nothing is), and per-token
    positions when sequences hold several packed records (None: each row is one sequence)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor | None = None


class PairBatch(NamedTuple):
    """One micro-batch of preference pairs: inputs and targets (B, 2, L), each pair's chosen row then its
    rejected row, one sequence per row; with their precomputed reference log-probabilities (B, 2) or None."""

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: None = None
    reference: torch.Tensor | None = None


def _stack(column: tuple) -> torch.Tensor | None:
    if column[0] is None:
        return None
    array = np.stack(column)
    return torch.from_numpy(array if array.dtype.kind == "f" else array.astype(np.int64))


def collate(samples: list[tuple[np.ndarray | None, ...]]) -> Batch | PairBatch:
    """Stack the samples of a source (each a tuple of per-sequence arrays, or None for a column the source
    does not have) into one micro-batch: a Batch, or a PairBatch from a source of pairs (four columns)."""
    columns = [_stack(column) for column in zip(*samples, strict=True)]
    return (PairBatch if len(columns) == 4 else Batch)(*columns)


class TokenSource:
    """Maps a global sample index to `seq_len + 1` tokens (inputs and shifted targets)."""

    def __init__(self, cfg: DataConfig, vocab_size: int, seq_len: int):
        self.cfg, self.vocab, self.seq_len = cfg, vocab_size, seq_len
        self.tokens: np.ndarray | None = None
        if cfg.source == "tokens":
            assert cfg.path is not None  # checked by the config model
            self.tokens = np.memmap(cfg.path, dtype=np.dtype(cfg.dtype), mode="r")
            if len(self.tokens) < seq_len + 2:
                raise ValueError(f"data.path {cfg.path} holds {len(self.tokens)} tokens, fewer than seqLen + 2")

    def sample(self, index: int) -> tuple[np.ndarray, ...]:
        """(inputs, targets) of global sample `index`."""
        row = self._row(index)
        return row[:-1], row[1:]

    def _row(self, index: int) -> np.ndarray:
        n = self.seq_len + 1
        if self.cfg.source == "synthetic":
            return (_mix(np.arange(index * n, (index + 1) * n), self.cfg.seed) % np.uint64(self.vocab)).astype(np.int64)
        if self.cfg.source == "learnable":
            # Counting mod a small alphabet by 1 or 2 from a random start: the next token follows from the
            # previous two, so even a tiny model's loss falls fast and far below chance (ln vocab).
            alphabet = min(self.vocab, 64)
            h = _mix(index, self.cfg.seed)
            start, stride = int(h % np.uint64(alphabet)), 1 + int((h >> np.uint64(16)) % np.uint64(2))
            return (start + stride * np.arange(n)) % alphabet
        assert self.tokens is not None
        span = len(self.tokens) - n
        offset = int(_mix(index, self.cfg.seed) % np.uint64(span))
        out = np.asarray(self.tokens[offset : offset + n], dtype=np.int64)
        if out.max(initial=0) >= self.vocab:
            raise ValueError(f"token {out.max()} in {self.cfg.path} is outside the model's vocabulary ({self.vocab})")
        return out


class ShardedLoader:
    """Yields this rank's micro-batches; `state_dict()` is the global data position. A source maps a global
    sample index to (inputs, targets[, positions]) arrays of one sequence."""

    def __init__(self, source, *, micro_batch: int, rank: int, world: int):
        self.source, self.micro_batch, self.rank, self.world = source, micro_batch, rank, world
        self.consumed = 0  # global samples consumed by all ranks together

    def next_batch(self) -> Batch:
        base = self.consumed + self.rank * self.micro_batch
        samples = [self.source.sample(base + j) for j in range(self.micro_batch)]
        self.consumed += self.micro_batch * self.world
        return collate(samples)

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])
