"""Each memory option of each strategy under real torchrun (2 agents x 2 processes, gloo): it trains the same
steps as the run without it, and it resumes from a checkpoint. Each option's run starts from the plain run's
step-10 checkpoint and must reproduce the plain run's steps 11-20. (What the options save in memory is
measured on GPUs: docs/benchmarks.md.)"""

from __future__ import annotations

import shutil

import pytest

from images import CACHE
from sharded_trainer.checkpoint.manager import committed_steps, step_dir
from support.torchrun_jobs import SCRIPTS, run_job, run_many, write_config

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
    # Inductor fuses the block's element-wise ops: the same math, a different float rounding order. Selective
    # checkpointing compiled: the policy is traced into the graph, and recomputing only the element-wise ops
    # changes no number.
    ("fsdp", {"strategy.fsdp.compile": True, "strategy.fsdp.activationCheckpointing": True,
              "strategy.fsdp.activationCheckpointingPolicy": "selective"}, 1e-4),
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


def compiles(options: dict) -> bool:
    return any(key.endswith(".compile") for key in options)


# Fresh 10-step bf16 runs, exported by the test below.
BF16 = {f"bf16-{s}": {"strategy.type": s, "precision": "bf16", "steps": 10} for s in ("fsdp", "zero2")}
# bf16-pure: a 20-step run, and the same run stopped after 10 steps and then resumed from its directory. A
# constant rate after the warm-up makes the first 10 steps of both the same.
PURE = {"strategy.type": "fsdp", "precision": "bf16-pure", "schedule.decay": "constant"}


def pure_configs(tmp) -> dict[str, object]:
    stopped = tmp / "pure-stopped"
    return {
        "pure": write_config(tmp / "pure", **PURE),
        "pure-stopped": write_config(stopped, **PURE, steps=10),
        "pure-resumed": write_config(tmp / "pure-resumed", **PURE, **{"checkpoint.dir": str(stopped / "ckpt")}),
    }


@pytest.fixture(scope="module")
def runs(plain, tmp_path_factory):
    """Each option's run from the plain run's step-10 checkpoint, and the bf16 runs, by name: (directory, run,
    Inductor cache). They share two launches (tests/trainer/scripts/train_many.py), the uncompiled runs and the
    compiled ones: a launch has one environment, and the uncompiled runs get an Inductor cache of their own,
    which must stay without kernels."""
    tmp = tmp_path_factory.mktemp("options")
    made = {}
    for compiled in (False, True):
        names, configs = [], []
        for option in OPTIONS:
            strategy, options, _ = option
            if compiles(options) != compiled:
                continue
            directory = tmp / option_id(option)
            (directory / "ckpt").mkdir(parents=True)
            shutil.copytree(step_dir(plain[strategy][0] / "ckpt", 10), step_dir(directory / "ckpt", 10))
            names.append(option_id(option))
            configs.append(write_config(directory, **{"strategy.type": strategy, **options}))
        if not compiled:
            names += BF16
            configs += [write_config(tmp / name, **settings) for name, settings in BF16.items()]
            pure = pure_configs(tmp)
            names += pure
            configs += pure.values()
        launch = tmp / ("compiled" if compiled else "eager")
        inductor = INDUCTOR_CACHE if compiled else launch / "inductor"
        env = {"TORCHINDUCTOR_CACHE_DIR": str(inductor), "DS_ACCELERATOR": "cpu", **INDUCTOR_LOG}
        for name, config, run in zip(names, configs, run_many(launch, configs, env=env), strict=True):
            made[name] = (config.parent, run, inductor)
    return made


@pytest.mark.parametrize("strategy,options,rel", OPTIONS, ids=[option_id(o) for o in OPTIONS])
def test_an_option_trains_the_same_steps_and_resumes(plain, runs, strategy, options, rel):
    _, plain_run = plain[strategy]
    directory, run, inductor = runs[option_id((strategy, options, rel))]
    assert run.event("resumed")["step"] == 10
    for step in range(11, 21):
        assert run.losses()[step] == pytest.approx(plain_run.losses()[step], rel=rel), step
    assert committed_steps(directory / "ckpt") == [10, 20]
    graphs = [line for line in run.output.splitlines() if "fx graph cache hit" in line or "fx graph cache miss" in line]
    assert bool(graphs) == compiles(options), graphs[:5]
    assert any(inductor.rglob("*.py")) == compiles(options), sorted(inductor.rglob("*"))[:20]


def test_gradients_reduced_in_bf16_travel_in_bf16_and_keep_the_trajectory(plain, tmp_path):
    """`reduceDtype: bf16` under fp32 parameters: every reduce-scatter carries bf16 (half the bytes), and the
    rounding of the summed gradients leaves the loss on the plain run's curve."""
    plain_dir, plain_run = plain["fsdp"]
    (tmp_path / "ckpt").mkdir()
    shutil.copytree(step_dir(plain_dir / "ckpt", 10), step_dir(tmp_path / "ckpt", 10))
    config = write_config(tmp_path, **{"strategy.fsdp.reduceDtype": "bf16"})
    record = tmp_path / "reduce-dtypes"
    script = [str(SCRIPTS / "record_reduce_dtype.py")]
    run = run_job(tmp_path, config, script=script, env={"REDUCE_DTYPES": str(record)})
    assert run.returncodes == [0, 0], run.output[-3000:]
    assert run.event("resumed")["step"] == 10
    for step in range(11, 21):
        assert run.losses()[step] == pytest.approx(plain_run.losses()[step], rel=1e-3), step
    for rank in range(4):
        assert (tmp_path / f"reduce-dtypes.{rank}").read_text().split() == ["torch.bfloat16"], rank
    assert committed_steps(tmp_path / "ckpt") == [10, 20]


@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_the_export_of_a_bf16_run_holds_fp32_master_weights_and_says_so(runs, strategy):
    import torch
    from safetensors import safe_open

    from sharded_api.loading import load_config
    from sharded_trainer.checkpoint.export import export_checkpoint

    directory, run, _ = runs[f"bf16-{strategy}"]
    assert run.event("finished")["step"] == 10
    config = directory / "trainer.yaml"
    out = export_checkpoint(load_config(str(config)), str(directory / "ckpt"), str(directory / "model.safetensors"))
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
        weights = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is no dict
    assert meta["dtype"] == "float32" and meta["trained_in"] == "bf16" and meta["weights"].startswith("fp32"), meta
    matrices = [w for w in weights.values() if w.dim() == 2]
    assert all(w.dtype == torch.float32 for w in weights.values())
    # Ten steps of AdamW moved the fp32 master weights off the bf16 grid: a bf16-rounded export would be on it.
    assert any((w.bfloat16().float() != w).any() for w in matrices)


def test_bf16_pure_keeps_every_weight_and_moment_in_bf16_learns_and_resumes_on_the_same_steps(runs):
    """precision bf16-pure: no fp32 copy anywhere in the checkpoint, the loss falls, and a run resumed from step
    10 reproduces the uninterrupted run's steps 11-20 exactly (the stochastic rounding is seeded by the step),
    and the export says its weights were bf16."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    from sharded_api.loading import load_config
    from sharded_trainer.checkpoint.export import export_checkpoint

    directory, whole, _ = runs["pure"]
    _, resumed, _ = runs["pure-resumed"]
    assert resumed.event("resumed")["step"] == 10
    losses = whole.losses()
    assert [resumed.losses()[step] for step in range(11, 21)] == [losses[step] for step in range(11, 21)]
    assert losses[20] < 0.5 * losses[1], losses
    meta = dcp.FileSystemReader(str(step_dir(directory / "ckpt", 20))).read_metadata().state_dict_metadata
    weights = {k: m.properties.dtype for k, m in meta.items() if k.startswith("model.")}
    moments = {k: m.properties.dtype for k, m in meta.items() if k.endswith((".exp_avg", ".exp_avg_sq"))}
    assert weights and set(weights.values()) == {torch.bfloat16}, weights
    assert set(moments.values()) == {torch.bfloat16}, moments
    assert {k.removeprefix("optim.state.").rsplit(".", 1)[0] for k in moments} <= {k[6:] for k in weights}
    out = export_checkpoint(load_config(str(directory / "trainer.yaml")), str(directory / "ckpt"),
                            str(directory / "model.safetensors"))  # fmt: skip
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
        matrices = [f.get_tensor(k) for k in f.keys() if f.get_slice(k).get_shape().__len__() == 2]  # noqa: SIM118
    assert meta["trained_in"] == "bf16-pure" and meta["weights"] == "bf16 sharded parameters", meta
    assert matrices and all((w.bfloat16().float() == w).all() for w in matrices)  # on bf16's grid: nothing lost
