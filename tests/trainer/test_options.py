"""Each memory option of each strategy under real torchrun (2 agents x 2 processes, gloo): it trains the same
steps as the run without it, and it resumes from a checkpoint. Each option's run starts from the plain run's
step-10 checkpoint and must reproduce the plain run's steps 11-20. (What the options save in memory is
measured on GPUs: docs/benchmarks.md.)"""

from __future__ import annotations

import shutil

import pytest

from helpers.torchrun_jobs import run_job, write_config
from sharded_trainer.checkpoint import committed_steps, step_dir

pytestmark = pytest.mark.trainer

OPTIONS = [  # (strategy, the options set, relative tolerance on the loss)
    ("fsdp", {"strategy.fsdp.activationCheckpointing": True}, 1e-5),
    ("fsdp", {"strategy.fsdp.cpuOffload": True}, 1e-5),
    ("fsdp", {"strategy.fsdp.reshardAfterForward": False}, 1e-5),
    ("zero2", {"strategy.zero2.activationCheckpointing": True}, 1e-5),
    # DeepSpeed's CPU Adam is its own kernel: the same update, not the same float rounding.
    ("zero2", {"strategy.zero2.cpuOffloadOptimizer": True}, 1e-3),
    ("zero2", {"strategy.zero2.overlapComm": False, "strategy.zero2.contiguousGradients": False}, 1e-5),
    # The smallest buckets the API allows: many reductions instead of one, the same sums.
    ("zero2", {"strategy.zero2.reduceBucketSize": 1_000_000, "strategy.zero2.allgatherBucketSize": 1_000_000}, 1e-5),
]


def option_id(option) -> str:
    strategy, options, _ = option
    return "-".join([strategy, *(f"{k.rsplit('.', 1)[1]}={v}" for k, v in options.items())])


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The run without options, per strategy: 20 steps, checkpoints at 10 and 20."""
    runs = {}
    for strategy in ("fsdp", "zero2"):
        tmp = tmp_path_factory.mktemp(f"plain-{strategy}")
        run = run_job(tmp, write_config(tmp, **{"strategy.type": strategy}))
        assert run.returncodes == [0, 0], run.output[-3000:]
        runs[strategy] = (tmp, run)
    return runs


@pytest.mark.parametrize("strategy,options,rel", OPTIONS, ids=[option_id(o) for o in OPTIONS])
def test_an_option_trains_the_same_steps_and_resumes(plain, tmp_path, strategy, options, rel):
    plain_dir, plain_run = plain[strategy]
    (tmp_path / "ckpt").mkdir()
    shutil.copytree(step_dir(plain_dir / "ckpt", 10), step_dir(tmp_path / "ckpt", 10))
    config = write_config(tmp_path, **{"strategy.type": strategy, **options})
    run = run_job(tmp_path, config)
    assert run.returncodes == [0, 0], run.output[-3000:]
    assert run.event("resumed")["step"] == 10
    for step in range(11, 21):
        assert run.losses()[step] == pytest.approx(plain_run.losses()[step], rel=rel), step
    assert committed_steps(tmp_path / "ckpt") == [10, 20]


@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_the_export_of_a_bf16_run_holds_fp32_master_weights_and_says_so(tmp_path, strategy):
    import torch
    from safetensors import safe_open

    from sharded_trainer.config import load_config
    from sharded_trainer.export import export_checkpoint

    config = write_config(tmp_path, **{"strategy.type": strategy, "precision": "bf16", "steps": 10})
    run = run_job(tmp_path, config)
    assert run.returncodes == [0, 0], run.output[-3000:]
    out = export_checkpoint(load_config(str(config)), str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors"))
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
        weights = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is no dict
    assert meta["dtype"] == "float32" and meta["trained_in"] == "bf16" and meta["weights"].startswith("fp32"), meta
    matrices = [w for w in weights.values() if w.dim() == 2]
    assert all(w.dtype == torch.float32 for w in weights.values())
    # Ten steps of AdamW moved the fp32 master weights off the bf16 grid: a bf16-rounded export would be on it.
    assert any((w.bfloat16().float() != w).any() for w in matrices)
