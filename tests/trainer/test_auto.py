"""strategy.type auto under real torchrun (2 agents x 2 processes, gloo): with no GPU the trainer takes the
fastest setting and says so; a job whose newest checkpoint is ZeRO-2's stays on ZeRO-2 and resumes it; the
export of an auto run reads the strategy from the checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.torchrun_jobs import ROOT, run_job, write_config

pytestmark = pytest.mark.trainer
DS = {"DS_ACCELERATOR": "cpu"}


def test_auto_settles_on_a_strategy_keeps_the_checkpoints_and_exports(tmp_path):
    first = run_job(tmp_path, write_config(tmp_path, **{"strategy.type": "zero2", "steps": 10}), env=DS)
    assert first.returncodes == [0, 0], first.output[-3000:]

    config = write_config(tmp_path, **{"strategy.type": "auto", "steps": 16, "strategy.zero2.compile": False})
    resumed = run_job(tmp_path, config, env=DS)
    assert resumed.returncodes == [0, 0], resumed.output[-3000:]
    auto = resumed.event("auto")
    assert auto["strategy"]["type"] == "zero2" and "the newest checkpoint is zero2's" in auto["why"], auto
    assert resumed.event("layout")["strategy"] == "zero2"
    assert resumed.event("resumed")["step"] == 10 and max(resumed.losses()) == 16

    out = subprocess.run([sys.executable, "-m", "sharded_trainer", "export", "--config", str(config),
                          "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "model.safetensors")],
                         cwd=ROOT, capture_output=True, text=True, env={**DS, "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.metadata()["strategy"] == "zero2" and f.metadata()["checkpoint"].endswith("16")

    fresh = tmp_path / "fresh"
    run = run_job(fresh, write_config(fresh, **{"strategy.type": "auto", "steps": 4}), env=DS)
    assert run.returncodes == [0, 0], run.output[-3000:]
    auto = run.event("auto")
    # No GPU, no memory bound: the fastest setting, FSDP2 keeping its gathered blocks.
    assert auto["strategy"]["type"] == "fsdp" and auto["strategy"]["fsdp"]["reshardAfterForward"] is False
    assert "no GPU" in auto["why"]
    progress = json.loads((fresh / "progress.json").read_text())
    assert progress["step"] == 4
