"""Launch the trainer the way a ShardedTrainingJob's pods do: one torchrun agent per node (the pods' own
`sharded_trainer.agent`, whose fork server imports torch and the trainer once per node), c10d rendezvous."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from localstack.cluster import free_port
from support.manifests import mutate

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "trainer" / "scripts"  # torchrun scripts of the trainer tier


def write_config(directory: Path, **overrides) -> Path:
    """A tiny-model CPU config: learnable data, fp32, checkpoints under `directory/ckpt`."""
    cfg = {
        "model": {"preset": "tiny"},
        "data": {"source": "learnable"},
        "steps": 20,
        "microBatchSize": 4,
        "seqLen": 32,
        "precision": "fp32",
        "optimizer": {"lr": 0.01},
        "schedule": {"warmupSteps": 2},
        "logEvery": 1,
        "checkpoint": {"dir": str(directory / "ckpt"), "interval": 10, "keepLast": 10},
        "progressFile": str(directory / "progress.json"),
    }
    cfg = mutate(cfg, overrides)
    path = directory / "trainer.yaml"
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


@dataclass
class Run:
    returncodes: list[int]
    output: str
    nodes: list[str] = field(default_factory=list)  # each node's log, where the run had several

    @property
    def metrics(self) -> list[dict]:
        return [json.loads(line.split(" ", 1)[1]) for line in self.output.splitlines() if line.startswith("METRICS ")]

    def losses(self) -> dict[int, float]:
        return {m["step"]: m["loss"] for m in self.metrics if "loss" in m}

    def event(self, name: str) -> dict | None:
        return next((m for m in self.metrics if m.get("event") == name), None)

    def tails(self, chars: int = 2500) -> str:
        """The end of each node's log (rank 0's lines are in the first, which the end of `output` leaves out)."""
        return "\n".join(f"--- node {i}:\n{log[-chars:]}" for i, log in enumerate(self.nodes or [self.output]))


def start_agents(
    config: Path,
    *,
    nodes: int = 2,
    procs: int = 2,
    script: list[str] | None = None,
    log_dir: Path,
    env: dict[str, str] | None = None,
) -> list[subprocess.Popen]:
    """One torchrun agent per node, all meeting at a c10d rendezvous on localhost. The trainer, and the
    helpers here that wrap its entry point, start as forks of the agent's preloaded server, as in a pod; any
    other script is spawned, as a pod spawns a user's command."""
    from sharded_trainer.agent import START_METHOD, torchrun_args

    port, run_id = free_port(), uuid.uuid4().hex[:8]
    if script and Path(script[0]).parent == SCRIPTS:
        target = ["--run-path", f"--start-method={START_METHOD}", *script]
    else:
        target = torchrun_args(script or ["-m", "sharded_trainer"])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    agents = []
    for rank in range(nodes):
        cmd = [
            sys.executable, "-m", "sharded_trainer.agent",
            f"--nnodes={nodes}", f"--nproc-per-node={procs}", f"--node-rank={rank}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
            "--max-restarts=0", "--monitor-interval=0.5",
            *target, "--config", str(config),
        ]  # fmt: skip
        log = open(log_dir / f"agent-{rank}.log", "w")  # noqa: SIM115 - closed with the process
        agents.append(
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        )
    return agents


def live_members(group: int) -> list[int]:
    """The processes of process group `group` that have not exited."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
            if int(pgrp) == group and state not in ("Z", "X"):
                members.append(int(stat.parent.name))
    return members


def wait_agents(agents: list[subprocess.Popen], log_dir: Path, timeout: float = 300) -> Run:
    """Each agent's run once every process of its node is gone: with the group SIGTERMed, as the tests stop
    a pod, the agent's fork server goes at once, and torchrun, no longer able to wait on the workers it
    forked, may exit while they still write their final checkpoint and its lines."""
    deadline = time.monotonic() + timeout
    try:
        for a in agents:
            a.wait(timeout=max(1, deadline - time.monotonic()))
        while any(live_members(a.pid) for a in agents) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for a in agents:
            if a.poll() is None or live_members(a.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    nodes = [(log_dir / f"agent-{i}.log").read_text() for i in range(len(agents))]
    return Run([a.returncode for a in agents], "\n".join(nodes), nodes)


def run_many(directory: Path, configs: list[Path], *, env=None, timeout: float = 600) -> list[Run]:
    """Several configs one after another in one launch (tests/trainer/scripts/train_many.py), which pays the launch
    (interpreters, imports, rendezvous) once: each run's output from rank 0's node, in the configs' order."""
    log_dir = directory / "logs"
    log_dir.mkdir(parents=True)
    listing = directory / "configs.txt"
    listing.write_text("\n".join(map(str, configs)))
    agents = start_agents(listing, script=[str(SCRIPTS / "train_many.py")], log_dir=log_dir, env=env)
    run = wait_agents(agents, log_dir, timeout)
    assert run.returncodes == [0, 0], run.output[-3000:]
    # Node 0's log, cut where rank 0 starts each run: a worker of node 0 reaches the next run's first
    # collective, and so logs anything of it, only after rank 0 has marked it.
    parts = (log_dir / "agent-0.log").read_text().split('METRICS {"event": "run"')[1:]
    assert len(parts) == len(configs), run.output[-3000:]
    return [Run([0], part) for part in parts]


def stop_at_step(
    config: Path, progress: Path, step: int, log_dir: Path, *, nodes: int = 2, script=None, env=None
) -> Run:
    """Start the agents, and once rank 0's progress file shows `step`, SIGTERM every agent's process group
    as the kubelet stops a pod; the run as it ended."""
    log_dir.mkdir(parents=True, exist_ok=True)
    agents = start_agents(config, nodes=nodes, script=script, log_dir=log_dir, env=env)
    deadline = time.monotonic() + 300
    reached = False
    while not reached and time.monotonic() < deadline and all(a.poll() is None for a in agents):
        reached = progress.exists() and json.loads(progress.read_text()).get("step", 0) >= step
        time.sleep(0.05)
    for a in agents:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(a.pid, signal.SIGTERM)
    run = wait_agents(agents, log_dir, timeout=120)
    # A stop before the workers run their loop (still importing, or at the rendezvous) is no stop under test.
    assert reached, f"step {step} was never reached: " + run.tails()
    return run


def run_job(
    directory: Path, config: Path, *, nodes: int = 2, procs: int = 2, script=None, timeout=300, env=None
) -> Run:
    log_dir = directory / f"logs-{uuid.uuid4().hex[:6]}"
    log_dir.mkdir(parents=True)
    agents = start_agents(config, nodes=nodes, procs=procs, script=script, log_dir=log_dir, env=env)
    return wait_agents(agents, log_dir, timeout)
