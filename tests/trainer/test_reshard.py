"""Resuming at another world size: ZeRO-2's partitioned optimizer state cut anew for the new world (exact,
both ways: 4 ranks -> 2 in fp32 and 2 -> 3 in bf16), and the global batch kept by gradient accumulation, so
the loss curve of a resized run continues the one it left."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from sharded_trainer.checkpoint.manager import committed_steps, step_dir
from support.torchrun_jobs import SCRIPTS, run_job, write_config

pytestmark = pytest.mark.trainer
W2 = {"strategy.type": "zero2", "microBatchSize": 2, "globalBatchSize": 12, "precision": "bf16"}
RELOAD = [str(SCRIPTS / "load_and_probe.py")]


def zero2_state(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's fp32 master weight and Adam moments, reassembled from DeepSpeed's files by
    name (written for this test: it shares nothing with the trainer's repartitioning)."""
    folder = directory / "zero2"
    model = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    files = sorted(folder.glob("*zero_pp_rank_*_optim_states.pt"),  # bf16_zero_pp_rank_... under bf16
                   key=lambda f: int(f.name.removeprefix("bf16_").split("_")[3]))  # fmt: skip
    parts = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"] for f in files]
    out: dict[str, dict[str, torch.Tensor]] = {"weights": {k: v.float() for k, v in model["module"].items()}}
    steps = set()
    for g, shapes in enumerate(model["param_shapes"]):
        lean = [p["single_partition_of_fp32_groups"][g] for p in parts]
        flats = {"master": torch.cat(lean)}
        for key in ("exp_avg", "exp_avg_sq"):
            states = [p["base_optimizer_state"]["state"][p["base_optimizer_state"]["param_groups"][g]["params"][0]]
                      for p in parts]  # fmt: skip
            flats[key] = torch.cat([s[key][: m.numel()] for s, m in zip(states, lean, strict=True)])
            steps |= {float(s["step"]) for s in states}
        offset = 0
        for name, shape in shapes.items():
            n = int(torch.Size(shape).numel())
            for key, flat in flats.items():
                out.setdefault(key, {})[name] = flat[offset : offset + n].view(shape)
            offset += n
        assert offset == flats["master"].numel()  # nothing in the partitions but the parameters
    out["step"] = {"adam": torch.tensor(sorted(steps))}
    groups = [p["base_optimizer_state"]["param_groups"] for p in parts]
    assert all(g == groups[0] for g in groups)  # the hyperparameters, the same in every partition
    out["hyperparameters"] = {
        f"{g}.{k}": torch.tensor(v, dtype=torch.float64)
        for g, group in enumerate(groups[0])
        for k, v in group.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
    out["scheduler"] = {k: torch.tensor(v) for k, v in model["lr_scheduler"].items() if isinstance(v, int | float)}
    return out


def event(run, name: str) -> dict:
    """A METRICS event's fields, without its name and time."""
    found = run.event(name)
    assert found, f"no {name} event:\n{run.output[-3000:]}"
    return {k: v for k, v in found.items() if k not in ("event", "time")}


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for kind in a:
        assert a[kind].keys() == b[kind].keys(), kind
        for name in a[kind]:
            assert torch.equal(a[kind][name], b[kind][name]), f"{kind} of {name} differs after the reload"


def resume_from(source: Path, step: int, into: Path) -> Path:
    """A fresh checkpoint root holding only `source`'s step `step`."""
    root = into / "ckpt"
    root.mkdir(parents=True)
    shutil.copytree(step_dir(source, step), step_dir(root, step))
    return root


@pytest.fixture(scope="module")
def world2_zero2(tmp_path_factory):
    """1 agent x 2 processes, micro-batch 2, global batch 12 (accumulating 3), 20 steps, in bf16: the
    saved module weights are bf16 and the fp32 masters live only in the partitions."""
    tmp = tmp_path_factory.mktemp("w2-zero2")
    config = write_config(tmp, **W2)
    run = run_job(tmp, config, nodes=1)
    assert run.returncodes == [0], run.output[-3000:]
    assert event(run, "batch") == {"global_batch": 12, "grad_accum_steps": 3, "world": 2}
    return tmp, config, run


@pytest.mark.parametrize(("saved", "nodes", "procs"), [("world4", 1, 2), ("world2", 3, 1)], ids=["4to2", "2to3"])
def test_zero2_reloads_at_another_world_size_with_every_state_exact(saved, nodes, procs, world4_run, world2_zero2,
                                                                    tmp_path):  # fmt: skip
    source, config = (world4_run("zero2")[1:3]) if saved == "world4" else world2_zero2[:2]
    out = tmp_path / "reloaded"
    run = run_job(tmp_path, config, nodes=nodes, procs=procs, script=[*RELOAD, "--step", "10", "--resave", str(out)])
    assert run.returncodes == [0] * nodes, run.output[-3000:]
    written = sorted(p.name for p in (out / "zero2").glob("*optim_states.pt"))
    assert len(written) == nodes * procs  # partitioned for the new world
    before, after = zero2_state(step_dir(source / "ckpt", 10)), zero2_state(out)
    assert before["step"]["adam"].tolist() == [10.0]
    assert_same_state(before, after)


@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_a_world_of_4_resumed_on_2_keeps_the_batch_and_continues_the_loss(strategy, world4_run, tmp_path):
    _, source, _, reference = world4_run(strategy)
    root = resume_from(source / "ckpt", 10, tmp_path)
    config = write_config(tmp_path, **{"strategy.type": strategy, "globalBatchSize": 16, "checkpoint.dir": str(root)})
    run = run_job(tmp_path, config, nodes=1)
    assert run.returncodes == [0], run.output[-3000:]
    assert event(run, "resumed") == {"step": 10, "from_world": 4, "world": 2}
    assert event(run, "batch")["grad_accum_steps"] == 2  # 4 x 2 accumulated x 2 = the 16 of the world of 4
    # The same samples per step, summed in another order: the curve continues, to rounding.
    ref, got = reference.losses(), run.losses()
    assert sorted(got) == list(range(11, 21))
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=2e-4), (step, got[step], ref[step])
    assert committed_steps(root) == [10, 20]
    state = json.loads((step_dir(root, 20) / "trainer.json").read_text())
    assert state["world"] == 2 and state["data"]["consumed"] == 20 * 16


def test_one_process_runs_the_model_unsharded_continues_a_world_of_4_and_a_world_of_2_shards_its_checkpoint(
    world4_run, tmp_path
):
    """One fp32 process: FSDP2 has nothing to shard or cast (fsdp_unsharded), so the model runs as it is. It
    resumes the sharded checkpoint of a world of 4, continues its loss curve, and writes plain tensors that a
    world of 2 shards again, weight for weight."""
    from sharded_api.loading import load_config
    from sharded_trainer.modeling.decoder import preset_network
    from sharded_trainer.strategies.fsdp import FsdpStrategy

    _, source, _, reference = world4_run("fsdp")
    root = resume_from(source / "ckpt", 10, tmp_path)
    config = write_config(tmp_path, **{"globalBatchSize": 16, "checkpoint.dir": str(root)})
    run = run_job(tmp_path, config, nodes=1, procs=1)
    assert run.returncodes == [0], run.output[-3000:]
    assert event(run, "layout")["layout"] == "unsharded: 1 process, fp32 parameters (nothing to shard or cast)"
    assert event(run, "resumed") == {"step": 10, "from_world": 4, "world": 1}
    assert event(run, "batch")["grad_accum_steps"] == 4
    ref, got = reference.losses(), run.losses()
    assert sorted(got) == list(range(11, 21))
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=2e-4), (step, got[step], ref[step])
    assert committed_steps(root) == [10, 20]

    out = tmp_path / "probe.pt"
    probe = run_job(tmp_path, config, nodes=1, procs=2, script=[*RELOAD, "--step", "20", "--out", str(out)])
    assert probe.returncodes == [0], probe.output[-3000:]
    found = torch.load(out, weights_only=False)
    assert found["world"] == 2
    written = FsdpStrategy.full_model_state(preset_network(load_config(str(config))).module, step_dir(root, 20))
    assert found["weights"].keys() == written.keys()
    for name, weight in written.items():
        assert torch.equal(found["weights"][name], weight), name


def test_a_zero2_world_of_2_resumed_on_3_keeps_the_batch_and_continues_the_loss(world2_zero2, tmp_path):
    source, _, reference = world2_zero2
    root = resume_from(source / "ckpt", 10, tmp_path)
    config = write_config(tmp_path, **W2, **{"checkpoint.dir": str(root)})
    run = run_job(tmp_path, config, nodes=3, procs=1)
    assert run.returncodes == [0, 0, 0], run.output[-3000:]
    assert event(run, "resumed")["from_world"] == 2
    assert event(run, "batch") == {"global_batch": 12, "grad_accum_steps": 2, "world": 3}
    ref, got = reference.losses(), run.losses()
    assert sorted(got) == list(range(11, 21))
    for step in got:  # bf16 compute: each micro-batch's rounding differs with the grouping
        assert got[step] == pytest.approx(ref[step], rel=1e-2), (step, got[step], ref[step])


def test_a_world_the_global_batch_does_not_divide_takes_the_nearest_batch_and_says_so(world4_run, tmp_path):
    """16 sequences over 3 processes of 4: 12 (accumulating 1) is nearer than 24."""
    _, source, _, _ = world4_run("fsdp")
    root = resume_from(source / "ckpt", 10, tmp_path)
    config = write_config(tmp_path, **{"globalBatchSize": 16, "steps": 12, "checkpoint.dir": str(root)})
    run = run_job(tmp_path, config, nodes=3, procs=1)
    assert run.returncodes == [0, 0, 0], run.output[-3000:]
    assert event(run, "batch") == {"global_batch": 12, "grad_accum_steps": 1, "world": 3, "requested": 16}
    assert event(run, "resumed")["step"] == 10 and sorted(run.losses()) == [11, 12]
