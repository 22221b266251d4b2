"""The pod's entry point under a real torchrun: SIGTERM to it alone (as the kubelet sends it to PID 1) at any
moment, and the final checkpoint gets the whole grace period."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from localstack.cluster import free_port
from sharded_api.contract import ExitCode, PodEnv
from sharded_trainer.agent import helper
from sharded_trainer.checkpoint.manager import committed_steps
from sharded_trainer.launch import children, workers
from sharded_trainer.train import STOP_AGREE_SECONDS
from support.torchrun_jobs import ROOT, SCRIPTS, write_config

pytestmark = pytest.mark.trainer


def launch(config, env: dict[str, str], command: list[str] | None = None) -> subprocess.Popen:
    """`python -m sharded_trainer.launch` as a pod runs it, in a session of its own: signals sent to its pid
    reach it alone, never its children."""
    script = ["--", *command] if command else []
    return subprocess.Popen(
        [sys.executable, "-m", "sharded_trainer.launch", "--config", str(config), *script],
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True,
    )  # fmt: skip


def until_first_checkpoint(proc: subprocess.Popen, ckpt: Path, timeout: float = 180) -> float:
    """Wait while the launcher runs until a checkpoint is committed under `ckpt`; returns the deadline used."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not committed_steps(ckpt):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    return deadline


@pytest.fixture(scope="module")
def store_port():
    """The job's rendezvous store as its pod runs it (`python -m sharded_trainer.store`), for every test here:
    each uses a rendezvous id of its own, as each attempt does."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sharded_trainer.store", "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    yield port
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "rendezvous store stopping" in out, out


def one_node(port: int) -> dict[str, str]:
    """A pod's torchrun variables, as the operator sets them: a client of the store at `port`, never its host."""
    return {
        PodEnv.NNODES: "1", PodEnv.NPROC_PER_NODE: "2", PodEnv.NODE_RANK: "0", PodEnv.RDZV_BACKEND: "c10d",
        PodEnv.RDZV_ENDPOINT: f"127.0.0.1:{port}", PodEnv.RDZV_ID: f"launch-{uuid.uuid4().hex[:8]}",
        PodEnv.RDZV_CONF: "is_host=false,join_timeout=120", PodEnv.MAX_RESTARTS: "0",
    }  # fmt: skip


def test_sigterm_to_the_launcher_alone_yields_a_final_checkpoint_and_exit_75(tmp_path, store_port):
    config = write_config(tmp_path, steps=100000, **{"checkpoint.interval": 100000})
    proc = launch(config, one_node(store_port))
    progress = tmp_path / "progress.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (progress.exists() and json.loads(progress.read_text())["step"] >= 3):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)  # the launcher only: torchrun and the workers hear it from the launcher
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == ExitCode.PREEMPTED, out[-3000:]
    assert "stopping: signal 15 to 2 workers" in out
    steps = committed_steps(tmp_path / "ckpt")
    assert steps and steps[-1] >= 3, out[-3000:]  # the interval never came: this is the final checkpoint


def test_sigterm_while_waiting_for_the_rendezvous_ends_the_wait_at_once(tmp_path):
    config = write_config(tmp_path)
    env = {**one_node(free_port()), PodEnv.NODE_RANK: "1", PodEnv.RDZV_ENDPOINT: "rendezvous.invalid:29400"}
    proc = launch(config, env)
    time.sleep(2)  # in the wait: the name does not resolve
    assert proc.poll() is None
    started = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == ExitCode.PREEMPTED, out
    assert "stopped while waiting for the rendezvous" in out and time.monotonic() - started < 10


def test_workers_get_longer_than_torchruns_own_30_seconds_to_stop(tmp_path, store_port):
    """torchrun kills its workers 30 s after its own SIGTERM; the launcher tells torchrun only once they are done."""
    config = write_config(tmp_path)
    script = [str(SCRIPTS / "slow_stop.py"), "--out", str(tmp_path)]
    proc = launch(config, one_node(store_port), script)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(tmp_path.glob("started-*"))) < 2:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert sorted(p.name for p in tmp_path.glob("saved-*")) == ["saved-0", "saved-1"], out[-3000:]
    assert proc.returncode == ExitCode.PREEMPTED, out[-3000:]


def test_a_killed_worker_is_restarted_in_place_and_training_resumes_from_the_newest_checkpoint(tmp_path, store_port):
    """failurePolicy.inPlaceRestarts: torchrun restarts the workers inside the pod (the launcher, as PID 1,
    never exits), they resume from the newest checkpoint, and the report says which restart this is."""
    config = write_config(tmp_path, steps=40, **{"checkpoint.interval": 10})
    proc = launch(config, {**one_node(store_port), PodEnv.MAX_RESTARTS: "2"})
    until_first_checkpoint(proc, tmp_path / "ckpt")
    [torchrun] = children(proc.pid)
    # The workers are forked by the agent's fork server, which imported torch before any worker started.
    [server] = [pid for pid in children(torchrun) if helper(pid) == "forkserver"]
    assert "libtorch_cpu.so" in Path(f"/proc/{server}/maps").read_text()
    # Forked from the agent after its imports (its command line is the agent's), so it imported nothing itself.
    assert Path(f"/proc/{server}/cmdline").read_bytes() == Path(f"/proc/{torchrun}/cmdline").read_bytes()
    running = workers(torchrun)
    assert len(running) == 2 and set(running) <= set(children(server))
    assert {Path(f"/proc/{pid}/comm").read_text().strip() for pid in running} == {Path(sys.executable).name[:15]}
    os.kill(running[1], signal.SIGKILL)  # no checkpoint, no goodbye
    # The restarted workers come from the same server: the restart forks, it does not import again.
    while proc.poll() is None and (len(workers(torchrun)) < 2 or set(workers(torchrun)) & set(running)):
        time.sleep(0.05)
    if proc.poll() is None:
        assert set(workers(torchrun)) <= set(children(server))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert out.count('"event": "started"') == 2  # the first run and the one restart
    resumed = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if '"event": "resumed"' in line]
    assert len(resumed) == 1 and resumed[0]["step"] >= 10 and resumed[0]["step"] % 10 == 0
    assert committed_steps(tmp_path / "ckpt")[-1] == 40
    assert json.loads((tmp_path / "progress.json").read_text())["restart"] == 1


def test_a_decision_of_the_trainer_is_not_restarted_in_place(tmp_path, store_port):
    """An incompatible checkpoint stays incompatible: with in-place restarts on, the workers still exit once
    and the pod's exit code is the decision's, not torchrun's 1."""
    config = write_config(tmp_path, steps=5, **{"checkpoint.interval": 5})
    first = subprocess.run([sys.executable, "-m", "sharded_trainer", "--config", str(config)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert first.returncode == 0, first.stdout[-2000:]
    other = write_config(tmp_path / "other", steps=10, **{"model.vocabSize": 512,
                                                          "checkpoint.dir": str(tmp_path / "ckpt")})  # fmt: skip
    proc = launch(other, {**one_node(store_port), PodEnv.MAX_RESTARTS: "3"})
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == ExitCode.INCOMPATIBLE_CHECKPOINT, out[-3000:]
    assert out.count('"event": "started"') == 1 and out.count('"event": "incompatible"') == 1, out[-3000:]


def test_an_old_writer_that_wakes_up_after_a_newer_one_started_cannot_commit(tmp_path):
    """Two trainers on one checkpoint directory, as a partitioned old attempt and its replacement: the one
    that started later takes the next generation on the claim, and the older one's next commit is refused."""
    config = write_config(tmp_path, steps=100000, **{"checkpoint.interval": 5})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    old = subprocess.Popen([sys.executable, "-m", "sharded_trainer", "--config", str(config)], env=env, cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not committed_steps(tmp_path / "ckpt"):
        time.sleep(0.05)
    resumed_from = committed_steps(tmp_path / "ckpt")[-1]
    new = subprocess.run(
        [sys.executable, "-m", "sharded_trainer", "--config", str(config), f"steps={resumed_from + 400}"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out, _ = old.communicate(timeout=120)
    assert old.returncode == ExitCode.FENCED, out[-3000:]
    assert '"event": "fenced"' in out and "is not committed" in out
    assert new.returncode == 0, new.stdout[-3000:]
    newest = committed_steps(tmp_path / "ckpt")[-1]
    marker = json.loads((tmp_path / "ckpt" / f"step-{newest:08d}" / "COMMITTED").read_text())
    assert newest == resumed_from + 400 and marker["generation"] == 2
    # Whatever the old writer left half-written is swept by the newer one.
    assert not list((tmp_path / "ckpt").glob("step-*.g1"))


def test_a_checkpoint_of_another_model_is_a_permanent_failure_naming_the_difference(tmp_path):
    config = write_config(tmp_path, steps=5, **{"checkpoint.interval": 5})
    first = subprocess.run([sys.executable, "-m", "sharded_trainer", "--config", str(config)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert first.returncode == 0 and committed_steps(tmp_path / "ckpt") == [5], first.stdout[-2000:]
    other = subprocess.run(
        [sys.executable, "-m", "sharded_trainer", "--config", str(config), "steps=10", "model.vocabSize=512"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert other.returncode == ExitCode.INCOMPATIBLE_CHECKPOINT, other.stdout[-3000:] + other.stderr[-3000:]
    assert "model.vocab_size: 256 -> 512" in other.stdout and '"event": "incompatible"' in other.stdout
    assert "Traceback" not in other.stderr
    assert committed_steps(tmp_path / "ckpt") == [5]  # left as it was, not mistaken for a corrupt checkpoint


def test_a_garbled_fingerprint_on_the_claim_is_refused_not_crashed_on(tmp_path):
    config = write_config(tmp_path, steps=5, **{"checkpoint.interval": 5})
    first = subprocess.run([sys.executable, "-m", "sharded_trainer", "--config", str(config)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert first.returncode == 0, first.stdout[-2000:]
    state_file = tmp_path / "ckpt" / "step-00000005" / "trainer.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "fingerprint": ["not", "a", "mapping"]}))
    again = subprocess.run([sys.executable, "-m", "sharded_trainer", "--config", str(config), "steps=10"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert again.returncode == ExitCode.INCOMPATIBLE_CHECKPOINT, again.stdout[-2000:] + again.stderr[-2000:]
    assert "fingerprint: unreadable (list)" in again.stdout and "Traceback" not in again.stderr


def test_workers_stopped_by_torchrun_with_a_frozen_peer_exit_without_waiting_for_torchruns_kill(tmp_path, store_port):
    """A SIGTERM that is not the launcher's comes from torchrun restarting the workers. With a peer frozen (a
    partitioned node) the stop can never be agreed; the worker leaves after STOP_AGREE_SECONDS without a
    checkpoint instead of waiting for torchrun's SIGKILL 30 s on, and the restarted workers resume and finish."""
    config = write_config(tmp_path, steps=40, **{"checkpoint.interval": 10})
    proc = launch(config, {**one_node(store_port), PodEnv.MAX_RESTARTS: "1"})
    deadline = until_first_checkpoint(proc, tmp_path / "ckpt")
    [torchrun] = children(proc.pid)
    first, frozen = workers(torchrun)
    os.kill(frozen, signal.SIGSTOP)  # cut off: its sockets stay open, it answers nothing
    os.kill(first, signal.SIGTERM)  # as torchrun stops its workers for a new round
    while Path(f"/proc/{first}").exists() and first in workers(torchrun):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(frozen, signal.SIGCONT)  # torchrun's own stop of it follows, as its SIGKILL would
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    # The wait is twice the slowest iteration (step, vote, save) plus a second, at least 2 s: on a loaded machine
    # a checkpoint's iteration takes longer than half a second, so the wait is longer than the least.
    agreed = re.search(r"did not agree on a final checkpoint within (\d+)s", out)
    assert agreed and int(agreed.group(1)) <= STOP_AGREE_SECONDS[1], out[-3000:]
    assert '"event": "preempted"' not in out  # no final checkpoint was attempted past the frozen peer
    resumed = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if '"event": "resumed"' in line]
    assert len(resumed) == 1 and resumed[0]["step"] % 10 == 0
    assert committed_steps(tmp_path / "ckpt")[-1] == 40
