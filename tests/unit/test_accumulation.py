"""The global batch kept across world sizes by gradient accumulation (trainer.globalBatchSize)."""

from __future__ import annotations

import pytest

from sharded_api.batch import accumulation_for, describe_batch, with_kept_batch
from sharded_api.config import TrainerConfig, TrainingSpec


@pytest.mark.parametrize(
    ("micro", "accum", "global_batch", "world", "expected"),
    [
        (4, 1, None, 4, (1, 16)),  # no global batch: the config's own accumulation
        (4, 3, None, 2, (3, 24)),
        (4, 1, 16, 4, (1, 16)),
        (4, 1, 16, 2, (2, 16)),  # half the processes, twice the accumulation
        (4, 1, 16, 1, (4, 16)),
        (2, 1, 12, 3, (2, 12)),
        (4, 1, 16, 3, (1, 12)),  # 12 is nearer 16 than 24
        (4, 1, 20, 3, (2, 24)),  # 24 is nearer 20 than 12
        (4, 1, 18, 3, (1, 12)),  # a tie: the smaller batch, less time per step
        (4, 1, 16, 8, (1, 32)),  # more processes than the batch has room for: one micro-batch each
        (1, 1, 1_048_576, 1, (1024, 1024)),  # bounded by gradAccumSteps' own limit
    ],
)
def test_accumulation_keeps_the_global_batch_or_the_nearest_one(micro, accum, global_batch, world, expected):
    spec = TrainingSpec(micro_batch_size=micro, grad_accum_steps=accum, global_batch_size=global_batch)
    assert accumulation_for(spec, world) == expected


def test_the_setting_says_when_the_batch_is_not_the_one_asked_for():
    spec = TrainingSpec(micro_batch_size=4, global_batch_size=16)
    assert describe_batch(spec, 2) == "global batch 16 (4 x 2 accumulated x 2 processes)"
    assert describe_batch(spec, 3) == (
        "global batch 12 (4 x 1 accumulated x 3 processes), the nearest to globalBatchSize 16 that 3 processes allow"
    )


def test_an_elastic_job_keeps_the_batch_of_its_full_size_at_every_world():
    """batch_nodes (the operator's elastic.keepGlobalBatch): 4 nodes x 2 processes x 4 sequences x 2
    accumulated = 64, kept on 3 nodes by the nearest accumulation and on 2 exactly; an explicit global
    batch wins, and without batch_nodes each process adds its own batch."""
    cfg = TrainerConfig(micro_batch_size=4, grad_accum_steps=2, batch_nodes=4)
    kept = with_kept_batch(cfg, procs_per_node=2)
    assert kept.global_batch_size == 64
    assert accumulation_for(kept, 4 * 2) == (2, 64)
    assert accumulation_for(kept, 2 * 2) == (4, 64)
    assert accumulation_for(kept, 3 * 2) == (3, 72)  # 72 is nearer 64 than 48
    explicit = TrainerConfig(micro_batch_size=4, global_batch_size=16, batch_nodes=4)
    assert with_kept_batch(explicit, procs_per_node=2).global_batch_size == 16
    assert with_kept_batch(TrainerConfig(micro_batch_size=4), procs_per_node=2).global_batch_size is None


@pytest.mark.parametrize("nodes", [0, -1, 1025, 10**12, "four", 2.5])
def test_batch_nodes_out_of_its_bounds_is_refused_naming_the_field(nodes):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"batch_nodes|batchNodes"):
        TrainerConfig(micro_batch_size=4, batch_nodes=nodes)
