"""An interactive job's pod entry point (sharded_trainer.interactive): what it tells the user, how JupyterLab is
started (loopback only, with a token), a config no run could use refused at once, and an idle node that a
SIGTERM ends as the signal would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from sharded_api.contract import ExitCode, PodEnv
from sharded_trainer.interactive import by_hand, jupyter_argv


def test_the_log_says_how_to_train_by_hand_with_this_pods_rendezvous():
    env = {PodEnv.JOB_NAME: "llm", PodEnv.NODE_RANK: "1", PodEnv.NNODES: "4", PodEnv.NPROC_PER_NODE: "8",
           PodEnv.RDZV_ENDPOINT: "llm-rdzv.llm:29400", PodEnv.RDZV_ID: "uid-3"}  # fmt: skip
    text = "\n".join(by_hand(env, "/etc/sharded/trainer.yaml"))
    assert "node 1 of 4 (8 processes each); rendezvous llm-rdzv.llm:29400, id uid-3" in text
    assert "sharded exec llm --node N" in text and "sharded_trainer.launch --config /etc/sharded/trainer.yaml" in text
    assert "PET_RDZV_ID=uid-3-2" in text


def test_jupyterlab_listens_on_loopback_only_with_the_token():
    argv = jupyter_argv(8888, "t0ken", "/checkpoints", root=False)
    assert argv[:3] == [sys.executable, "-m", "jupyterlab"]
    assert "--ServerApp.ip=127.0.0.1" in argv and "--ServerApp.port=8888" in argv
    assert "--ServerApp.port_retries=0" in argv  # another port would not be the one the user forwards
    assert "--IdentityProvider.token=t0ken" in argv and "--ServerApp.root_dir=/checkpoints" in argv
    assert "--allow-root" not in argv and "--allow-root" in jupyter_argv(8888, "t", "/", root=True)


def run(config: str, tmp_path, rank: str, **kw) -> subprocess.Popen:
    path = tmp_path / "trainer.yaml"
    path.write_text(config)
    env = {**os.environ, PodEnv.NODE_RANK: rank, PodEnv.JOB_NAME: "llm"}
    return subprocess.Popen([sys.executable, "-m", "sharded_trainer.interactive", "--config", str(path)], env=env,
                            stderr=subprocess.PIPE, text=True, **kw)  # fmt: skip


def test_a_config_no_run_could_use_fails_the_pod_at_once(tmp_path):
    proc = run("steps: -3\n", tmp_path, "0")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == ExitCode.INVALID_CONFIG and "steps" in err


def test_an_idle_node_waits_and_a_sigterm_ends_it_as_the_signal_would(tmp_path):
    proc = run("steps: 10\n", tmp_path, "1")
    lines = []
    while "this node idles" not in (line := proc.stderr.readline()):
        assert line, lines
        lines.append(line)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
