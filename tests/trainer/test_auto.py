"""strategy.type auto under real torchrun (2 agents x 2 processes, gloo): with no GPU the trainer takes the
fastest setting and says so; a job whose newest checkpoint is ZeRO-2's stays on ZeRO-2 and resumes it; the
export of an auto run reads the strategy from the checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.torchrun_jobs import ROOT, run_many, write_config

pytestmark = pytest.mark.trainer
DS = {"DS_ACCELERATOR": "cpu"}


def test_auto_settles_on_a_strategy_keeps_the_checkpoints_and_exports(tmp_path):
    # One launch, runs in order: ZeRO-2 for 10 steps; auto on its checkpoints; auto on an empty directory.
    ckpt, fresh = tmp_path / "ckpt", tmp_path / "fresh"
    first = write_config(tmp_path / "first", **{"strategy.type": "zero2", "steps": 10, "checkpoint.dir": str(ckpt)})
    config = write_config(tmp_path / "auto", **{"strategy.type": "auto", "steps": 16, "strategy.zero2.compile": False,
                                                "checkpoint.dir": str(ckpt)})  # fmt: skip
    _, resumed, run = run_many(tmp_path, [first, config, write_config(fresh, **{"strategy.type": "auto", "steps": 4})],
                               env=DS)  # fmt: skip
    auto = resumed.event("auto")
    assert auto["strategy"]["type"] == "zero2" and "the newest checkpoint is zero2's" in auto["why"], auto
    assert resumed.event("layout")["strategy"] == "zero2"
    assert resumed.event("resumed")["step"] == 10 and max(resumed.losses()) == 16

    out = subprocess.run([sys.executable, "-m", "sharded_trainer", "export", "--config", str(config),
                          "--checkpoint", str(ckpt), "--out", str(tmp_path / "model.safetensors")],
                         cwd=ROOT, capture_output=True, text=True, env={**DS, "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.metadata()["strategy"] == "zero2" and f.metadata()["checkpoint"].endswith("16")

    auto = run.event("auto")
    # No GPU, no memory bound: the fastest setting, FSDP2 keeping its gathered blocks.
    assert auto["strategy"]["type"] == "fsdp" and auto["strategy"]["fsdp"]["reshardAfterForward"] is False
    assert "no GPU" in auto["why"]
    progress = json.loads((fresh / "progress.json").read_text())
    assert progress["step"] == 4
