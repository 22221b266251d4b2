"""Each memory option of each strategy under real torchrun (2 agents x 2 processes, gloo): it trains the same
steps as the run without it, and it resumes from a checkpoint. Each option's run starts from the plain run's
step-10 checkpoint and must reproduce the plain run's steps 11-20. (What the options save in memory is
measured on GPUs: docs/benchmarks.md.)"""

from __future__ import annotations

import shutil

import pytest

from helpers.torchrun_jobs import HELPERS, run_job, write_config
from images import CACHE
from sharded_trainer.checkpoint import committed_steps, step_dir

pytestmark = pytest.mark.trainer
# Compiled runs share one Inductor cache, kept across runs and clean clones as the virtualenv is: Inductor keys
# every graph it keeps by the graph, its inputs, its own configuration and torch's version, so a kernel is
# generated once per machine and loaded after that (a cold compile costs each of the four processes ~15 s).
INDUCTOR_CACHE = CACHE / "inductor"
# Inductor's cache says, per graph, whether it generated the kernels or loaded them: either line shows that
# the blocks ran through Inductor, whatever the cache held before.
INDUCTOR_LOG = {"TORCH_LOGS": "torch._inductor.codecache"}

OPTIONS = [  # (strategy, the options set, relative tolerance on the loss)
    # Options that only move work around (recompute, keep gathered, reduce in other buckets) share a run: one
    # launch checks each of them, and a change that broke any one of them breaks the run.
    ("fsdp", {"strategy.fsdp.activationCheckpointing": True, "strategy.fsdp.reshardAfterForward": False}, 1e-5),
    ("fsdp", {"strategy.fsdp.cpuOffload": True}, 1e-5),
    # Inductor fuses the block's element-wise ops: the same math, a different float rounding order.
    ("fsdp", {"strategy.fsdp.compile": True}, 1e-4),
    ("zero2", {"strategy.zero2.compile": True}, 1e-4),
    # DeepSpeed's CPU Adam is its own kernel: the same update, not the same float rounding.
    ("zero2", {"strategy.zero2.cpuOffloadOptimizer": True}, 1e-3),
    # With the smallest buckets the API allows: many reductions instead of one, the same sums.
    ("zero2", {"strategy.zero2.activationCheckpointing": True, "strategy.zero2.overlapComm": False,
               "strategy.zero2.contiguousGradients": False, "strategy.zero2.reduceBucketSize": 1_000_000,
               "strategy.zero2.allgatherBucketSize": 1_000_000}, 1e-5),
]  # fmt: skip


def option_id(option) -> str:
    strategy, options, _ = option
    return "-".join([strategy, *(f"{k.rsplit('.', 1)[1]}={v}" for k, v in options.items())])


@pytest.fixture(scope="module")
def plain(world4_run):
    """The run without options, per strategy (20 steps, checkpoints at 10 and 20): the session's shared one."""
    runs = {}
    for strategy in ("fsdp", "zero2"):
        _, directory, _, run = world4_run(strategy)
        runs[strategy] = (directory, run)
    return runs


@pytest.mark.parametrize("strategy,options,rel", OPTIONS, ids=[option_id(o) for o in OPTIONS])
def test_an_option_trains_the_same_steps_and_resumes(plain, tmp_path, strategy, options, rel):
    plain_dir, plain_run = plain[strategy]
    (tmp_path / "ckpt").mkdir()
    shutil.copytree(step_dir(plain_dir / "ckpt", 10), step_dir(tmp_path / "ckpt", 10))
    config = write_config(tmp_path, **{"strategy.type": strategy, **options})
    compiled = any(key.endswith(".compile") for key in options)
    # An uncompiled run gets a cache of its own, which must stay without kernels.
    inductor = INDUCTOR_CACHE if compiled else tmp_path / "inductor"
    run = run_job(tmp_path, config, env={"TORCHINDUCTOR_CACHE_DIR": str(inductor), **INDUCTOR_LOG})
    assert run.returncodes == [0, 0], run.output[-3000:]
    assert run.event("resumed")["step"] == 10
    for step in range(11, 21):
        assert run.losses()[step] == pytest.approx(plain_run.losses()[step], rel=rel), step
    assert committed_steps(tmp_path / "ckpt") == [10, 20]
    graphs = [line for line in run.output.splitlines() if "fx graph cache hit" in line or "fx graph cache miss" in line]
    assert bool(graphs) == compiled, graphs[:5]
    assert any(inductor.rglob("*.py")) == compiled, sorted(inductor.rglob("*"))[:20]


def test_gradients_reduced_in_bf16_travel_in_bf16_and_keep_the_trajectory(plain, tmp_path):
    """`reduceDtype: bf16` under fp32 parameters: every reduce-scatter carries bf16 (half the bytes), and the
    rounding of the summed gradients leaves the loss on the plain run's curve."""
    plain_dir, plain_run = plain["fsdp"]
    (tmp_path / "ckpt").mkdir()
    shutil.copytree(step_dir(plain_dir / "ckpt", 10), step_dir(tmp_path / "ckpt", 10))
    config = write_config(tmp_path, **{"strategy.fsdp.reduceDtype": "bf16"})
    record = tmp_path / "reduce-dtypes"
    script = [str(HELPERS / "record_reduce_dtype.py")]
    run = run_job(tmp_path, config, script=script, env={"REDUCE_DTYPES": str(record)})
    assert run.returncodes == [0, 0], run.output[-3000:]
    assert run.event("resumed")["step"] == 10
    for step in range(11, 21):
        assert run.losses()[step] == pytest.approx(plain_run.losses()[step], rel=1e-3), step
    for rank in range(4):
        assert (tmp_path / f"reduce-dtypes.{rank}").read_text().split() == ["torch.bfloat16"], rank
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
