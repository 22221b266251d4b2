"""How the launcher has torchrun start the trainer's workers (sharded_trainer.agent.torchrun_args)."""

from __future__ import annotations

import pytest

from sharded_api.contract import PodEnv
from sharded_trainer import agent
from sharded_trainer.agent import HF_PRELOAD, PRELOAD, WORKER, preload, torchrun_args

TRAINER = ["-m", "sharded_trainer", "--config", "/etc/sharded/trainer.yaml"]


def test_the_trainer_runs_as_a_function_forked_by_the_preloading_server(monkeypatch):
    monkeypatch.delenv(PodEnv.WORKER_START, raising=False)
    assert torchrun_args(TRAINER) == ["--run-path", "--start-method=forkserver", WORKER, *TRAINER[2:]]
    assert WORKER.endswith("sharded_trainer/__main__.py")


def test_spawn_and_a_users_command_start_workers_as_torchrun_always_does(monkeypatch):
    monkeypatch.setenv(PodEnv.WORKER_START, "spawn")
    assert torchrun_args(TRAINER) == TRAINER
    monkeypatch.delenv(PodEnv.WORKER_START)
    assert torchrun_args(["train.py", "--lr", "1e-4"]) == ["train.py", "--lr", "1e-4"]


def test_an_unknown_start_method_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(PodEnv.WORKER_START, "fork")  # forking torchrun's threaded agent is unsafe
    with pytest.raises(ValueError, match="SHARDED_WORKER_START must be forkserver or spawn, not 'fork'"):
        torchrun_args(TRAINER)


def test_the_server_preloads_transformers_and_peft_only_for_a_job_that_uses_them(tmp_path, monkeypatch):
    """A Hugging Face job's workers import transformers (and peft with LoRA) on the way to their first step:
    on a node without GPUs the server imports them once instead; a preset job's server does not pay for
    modules it never uses. On a GPU node it never does: importing them probes CUDA, which the forked workers
    could then not use."""
    monkeypatch.setattr(agent, "GPU_DEVICES", (str(tmp_path / "nvidiactl"),))
    preset, hf, lora = tmp_path / "preset.yaml", tmp_path / "hf.yaml", tmp_path / "lora.json"
    preset.write_text("model: {preset: tiny}\n")
    hf.write_text("model:\n  huggingface: {path: /models/m}\n")
    lora.write_text('{"model": {"huggingface": {"path": "/models/m"}}, "lora": {"r": 8}}')  # JSON is YAML
    assert preload(["--nnodes=1", WORKER, "--config", str(preset)]) == PRELOAD
    assert preload([WORKER, "--config", str(hf)]) == [*PRELOAD, *HF_PRELOAD]
    assert preload([WORKER, f"--config={lora}"]) == [*PRELOAD, *HF_PRELOAD, "peft"]
    (tmp_path / "nvidiactl").touch()  # a GPU node
    assert preload([WORKER, f"--config={lora}"]) == PRELOAD


@pytest.mark.parametrize("body", [None, b"\xff\xfe", "model: [unclosed", "- a list", "model: 3"])
def test_a_config_the_server_cannot_read_only_means_no_extra_imports(tmp_path, body):
    """The worker reports a missing or broken config (naming it); the server only preloads the defaults."""
    path = tmp_path / "trainer.yaml"
    if isinstance(body, bytes):
        path.write_bytes(body)
    elif body is not None:
        path.write_text(body)
    assert preload([WORKER, "--config", str(path)]) == PRELOAD
    assert preload([WORKER]) == PRELOAD


SERVE = """
import json, multiprocessing, os, sys, threading
from pathlib import Path
from sharded_trainer import agent
if sys.argv[1] == "thread":  # a thread already running, as torchrun's are once it starts
    threading.Thread(target=threading.Event().wait, daemon=True).start()
os.environ["PYTHONUNBUFFERED"] = "1"  # as agent.main() sets it: after this interpreter made its streams
agent.start_server(["json"])
server = multiprocessing.forkserver._forkserver._forkserver_pid
# A worker's line, and an exit that flushes nothing.
child = multiprocessing.get_context("forkserver").Process(
    target=exec, args=("import os; print('a line from the worker'); os._exit(7)",))
child.start()
child.join()
print(json.dumps({"helper": agent.helper(server), "exit": child.exitcode,
                  "comm": Path(f"/proc/{server}/comm").read_text().strip(),
                  "cmdline": Path(f"/proc/{server}/cmdline").read_text()}))
"""


@pytest.mark.parametrize("threads", ["none", "thread"])
def test_the_server_is_forked_from_the_agent_unless_a_thread_runs_and_forks_workers_either_way(threads):
    """Forked, the server has the agent's imports and command line and is told apart by its name; with a
    thread running (forking then is unsafe) it is spawned and imports for itself, as multiprocessing does."""
    import json
    import os
    import subprocess
    import sys

    from localstack.nodeagent import FORKED_SERVER

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # output to a pipe: block-buffered
    out = subprocess.run([sys.executable, "-c", SERVE, threads], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    *lines, last = out.stdout.splitlines()
    got = json.loads(last)
    assert got["exit"] == 7 and got["helper"] == "forkserver"  # it forks a working process; launch finds it
    assert lines == ["a line from the worker"]  # written through, as by a spawned server's `python -u` workers
    if threads == "none":
        assert got["comm"] == agent.SERVER_NAME.decode() == FORKED_SERVER.decode()
        assert got["cmdline"].split("\0")[-2] == "none"  # the agent's own command line
    else:
        assert "from multiprocessing.forkserver import main" in got["cmdline"]
