"""Token sources: deterministic, disjoint per-rank shards, and a data position that survives restarts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sharded_api.config import DataConfig
from sharded_trainer.data.sources import ShardedLoader, TokenSource


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "tokens.bin"
    (np.arange(10_000, dtype=np.uint32) % 1000).tofile(path)
    return path


def loaders(source, world, micro=2):
    return [ShardedLoader(source, micro_batch=micro, rank=r, world=world) for r in range(world)]


@pytest.mark.parametrize("kind", ["synthetic", "learnable", "tokens"])
def test_ranks_read_disjoint_samples_and_targets_are_shifted_inputs(kind, token_file):
    cfg = DataConfig(source=kind, path=str(token_file) if kind == "tokens" else None, dtype="uint32")
    source = TokenSource(cfg, vocab_size=1000, seq_len=16)
    (x0, y0, p0), (x1, _, _) = (loader.next_batch() for loader in loaders(source, world=2))
    assert p0 is None  # one sequence per row: no positions
    assert x0.shape == (2, 16) and x0.dtype == torch.int64
    assert torch.equal(x0[:, 1:], y0[:, :-1])
    assert not torch.equal(x0, x1)
    assert int(x0.max()) < 1000


def test_the_data_position_resumes_exactly_and_across_world_sizes(token_file):
    cfg = DataConfig(source="tokens", path=str(token_file), dtype="uint32")
    source = TokenSource(cfg, vocab_size=1000, seq_len=16)
    a = ShardedLoader(source, micro_batch=2, rank=0, world=1)
    for _ in range(3):
        a.next_batch()
    expected = a.next_batch()
    b = ShardedLoader(source, micro_batch=2, rank=0, world=1)
    b.load_state_dict({"consumed": 6})
    assert torch.equal(b.next_batch()[0], expected[0])
    # Two ranks after the same position together read what one rank reads in one global batch of 4.
    one = ShardedLoader(source, micro_batch=4, rank=0, world=1)
    one.load_state_dict({"consumed": 6})
    halves = []
    for r in range(2):
        loader = ShardedLoader(source, micro_batch=2, rank=r, world=2)
        loader.load_state_dict({"consumed": 6})
        halves.append(loader.next_batch()[0])
    assert torch.equal(torch.cat(halves), one.next_batch()[0])


def test_tokens_outside_the_vocabulary_are_refused(token_file):
    source = TokenSource(DataConfig(source="tokens", path=str(token_file), dtype="uint32"), vocab_size=100, seq_len=16)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        for i in range(50):
            source.sample(i)


def test_a_file_shorter_than_a_sequence_is_refused(tmp_path):
    path = tmp_path / "short.bin"
    np.zeros(5, dtype=np.uint16).tofile(path)
    with pytest.raises(ValueError, match="fewer than seqLen"):
        TokenSource(DataConfig(source="tokens", path=str(path)), vocab_size=10, seq_len=16)
