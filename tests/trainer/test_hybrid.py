"""Hybrid sharding under real torchrun: shard within each node, replicate across nodes (a 2x2 mesh on 2 agents x
2 processes, gloo). It is the same data-parallel training as full sharding, and its checkpoints load under
either layout and at another node count."""

from __future__ import annotations

import shutil

import pytest
import torch

from sharded_api.loading import load_config
from sharded_trainer.checkpoint.export import load_model_state
from sharded_trainer.checkpoint.manager import committed_steps, step_dir
from support.torchrun_jobs import SCRIPTS, run_job, run_many, write_config

pytestmark = pytest.mark.trainer


def weights(config, directory, step):
    return load_model_state(load_config(str(config)), step_dir(directory / "ckpt", step))


def test_hybrid_sharding_trains_as_full_sharding_does_and_its_checkpoints_load_under_either(tmp_path):
    full_dir, hybrid_dir = tmp_path / "full", tmp_path / "hybrid"
    full_cfg = write_config(full_dir, **{"strategy.type": "fsdp"})
    hybrid_cfg = write_config(hybrid_dir, **{"strategy.type": "fsdp", "strategy.fsdp.shard": "hybrid"})
    # The full checkpoint resumed with hybrid sharding, in the same launch once the full run has written it.
    full_as_hybrid = write_config(tmp_path / "full-as-hybrid", **{
        "strategy.type": "fsdp", "strategy.fsdp.shard": "hybrid", "steps": 30, "checkpoint.dir": str(full_dir / "ckpt")
    })  # fmt: skip
    full, hybrid, resumed = run_many(tmp_path, [full_cfg, hybrid_cfg, full_as_hybrid])
    assert hybrid.event("layout")["layout"].startswith("hybrid: 2 replicas x 2 shards")
    assert full.event("layout")["layout"].startswith("full: 4 shards")
    # Same data, same seed, same optimizer: only the order of the gradient reductions differs.
    for step, loss in full.losses().items():
        assert hybrid.losses()[step] == pytest.approx(loss, rel=1e-4), step
    a, b = weights(full_cfg, full_dir, 20), weights(hybrid_cfg, hybrid_dir, 20)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)

    assert resumed.event("resumed")["step"] == 20
    assert resumed.losses()[21] == pytest.approx(full.losses()[20], rel=0.5)  # continues, no jump back to chance

    # The hybrid checkpoint resumed with full sharding on one node of 2.
    on_one_node = tmp_path / "one-node"
    on_one_node.mkdir()
    shutil.copytree(hybrid_dir / "ckpt", on_one_node / "ckpt")
    cfg = write_config(on_one_node, **{"strategy.type": "fsdp", "steps": 30})
    resumed = run_job(on_one_node, cfg, nodes=1)
    assert resumed.returncodes == [0], resumed.output[-3000:]
    assert resumed.event("resumed")["step"] == 20 and committed_steps(on_one_node / "ckpt")[-1] == 30


def test_every_prefetch_value_sets_a_different_plan(tmp_path):
    import json
    import subprocess
    import sys

    from support.torchrun_jobs import ROOT

    out = subprocess.run([sys.executable, str(SCRIPTS / "prefetch_plan.py")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("PLAN ")), None)
    assert line, out.stdout[-2000:] + out.stderr[-3000:]
    plans = {int(k): v for k, v in json.loads(line[5:]).items()}
    n = len(plans[0]["forward"])
    assert n == 12 and plans[0] == {"forward": [0] * n, "backward": [0] * n}  # FSDP2's implicit order
    for k in range(1, 5):
        assert plans[k]["forward"] == [min(k, n - 1 - i) for i in range(n)], k
        assert plans[k]["backward"] == [min(k, i) for i in range(n)], k
