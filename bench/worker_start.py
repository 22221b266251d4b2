"""Worker start-up under the pod's launcher, spawned against forked from the preloading server, side by side:
a cold start and an in-place restart after a SIGKILLed worker, broken into phases.

    .venv/bin/python bench/worker_start.py --repeat 2 --out bench/results/recovery/worker-start-cpu.json
    python3 bench/worker_start.py --procs 1 --repeat 2 --out $OUT/worker-start-h200.json   # on the GPU machine

Each arm runs `python -m sharded_trainer.launch` as a pod does (one node, `--procs` workers, a rendezvous
store process beside it, `failurePolicy.inPlaceRestarts` 1) with `SHARDED_WORKER_START` set to `spawn` (torchrun
spawns a fresh interpreter per worker, as torchrun always does) or `forkserver` (the default). The arms
alternate within each repeat. Times come from the trainer's `METRICS` lines (Unix times):

    cold        launcher started -> the first step (imports, rendezvous, process group, model, first step)
    rendezvous  worker killed -> the restarted rank 0's process group up (torchrun's restart, worker start)
    load        -> resumed from the newest checkpoint (model built, wrapped, state loaded)
    first step  -> the first step after the resume

Uses CUDA and nccl where a GPU is visible (backend auto), else gloo on CPU. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for sub in ("operator", "trainer", "hack", "tests"):
    sys.path.insert(0, str(ROOT / sub))

PHASES = ["rendezvous", "load", "first step"]


def marks(log: str, after: float) -> dict[str, float]:
    """When, after `after`, rank 0's process group came up, it resumed, and it logged a step after that."""
    out: dict[str, float] = {}
    for line in log.splitlines():
        if not line.startswith("METRICS "):
            continue
        rec = json.loads(line[len("METRICS ") :])
        if rec.get("time", 0) < after:
            continue
        if rec.get("event") == "started":
            out.setdefault("rendezvous", rec["time"])
        elif rec.get("event") == "resumed":
            out.setdefault("load", rec["time"])
        elif "event" not in rec and "step" in rec:
            out.setdefault("step", rec["time"])
            if "load" in out:
                out.setdefault("first step", rec["time"])
    return out


def arm(start: str, procs: int, workdir: Path) -> dict:
    from localstack.cluster import free_port
    from sharded_api.contract import PodEnv
    from sharded_trainer.checkpoint.manager import committed_steps
    from sharded_trainer.launch import children, workers
    from support.torchrun_jobs import write_config

    directory = workdir / f"{start}-{uuid.uuid4().hex[:6]}"
    config = write_config(directory, steps=1_000_000, **{"checkpoint.interval": 5})
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "sharded_trainer.store", "--port", str(port)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    env = {
        **os.environ, "PYTHONUNBUFFERED": "1", PodEnv.WORKER_START: start,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "trainer"), os.environ.get("PYTHONPATH", "")]),
        PodEnv.NNODES: "1", PodEnv.NPROC_PER_NODE: str(procs), PodEnv.NODE_RANK: "0", PodEnv.RDZV_BACKEND: "c10d",
        PodEnv.RDZV_ENDPOINT: f"127.0.0.1:{port}", PodEnv.RDZV_ID: uuid.uuid4().hex[:8],
        PodEnv.RDZV_CONF: "is_host=false,join_timeout=300", PodEnv.MAX_RESTARTS: "1",
    }  # fmt: skip
    log_path = directory / "launch.log"
    launched = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "sharded_trainer.launch", "--config", str(config)], cwd=ROOT,
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not committed_steps(directory / "ckpt"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{start}: no checkpoint\n{log_path.read_text()[-3000:]}")
            time.sleep(0.05)
        cold = marks(log_path.read_text(), launched)["step"] - launched
        [agent] = children(proc.pid)
        victim = workers(agent)[-1]
        fault = time.time()
        os.kill(victim, signal.SIGKILL)
        while "first step" not in (found := marks(log_path.read_text(), fault)):
            if proc.poll() is not None or time.monotonic() > deadline + 300:
                raise RuntimeError(f"{start}: no resume\n{log_path.read_text()[-3000:]}")
            time.sleep(0.05)
    finally:
        # torchrun starts spawned workers in sessions of their own: the launcher's group does not reach them.
        doomed, stack = [], [proc.pid]
        while stack:
            pid = stack.pop()
            doomed.append(pid)
            stack.extend(children(pid))
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        store.kill()
        store.wait()
    phases, previous = {}, fault
    for phase in PHASES:
        phases[phase] = round(found[phase] - previous, 3)
        previous = found[phase]
    return {"start": start, "cold": round(cold, 3), **phases, "restart": round(found["first step"] - fault, 3)}


def table(results: list[dict]) -> str:
    cols = ["cold", *PHASES, "restart"]
    rows = ["| workers | n | " + " | ".join(cols) + " | spawn / this (restart) |",
            "| --- | ---: |" + " ---: |" * (len(cols) + 1)]  # fmt: skip
    medians = {}
    for start in ("spawn", "forkserver"):
        runs = [r for r in results if r["start"] == start]
        medians[start] = {c: statistics.median(r[c] for r in runs) for c in cols}
    for start, m in medians.items():
        ratio = medians["spawn"]["restart"] / m["restart"]
        n = sum(r["start"] == start for r in results)
        rows.append(f"| {start} | {n} | " + " | ".join(f"{m[c]:.2f}" for c in cols) + f" | {ratio:.2f}x |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, default=2, help="workers on the node")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    results = []
    with tempfile.TemporaryDirectory(prefix="worker-start-", ignore_cleanup_errors=True) as tmp:
        for i in range(args.repeat):
            # Alternate which goes first, so neither always meets a warmer page cache.
            for start in ("spawn", "forkserver") if i % 2 == 0 else ("forkserver", "spawn"):
                result = arm(start, args.procs, Path(tmp))
                results.append(result)
                print(f"[worker-start] {i + 1}/{args.repeat} {json.dumps(result)}", flush=True)
    print(table(results))
    if args.out:
        try:  # the GPU machine has no git: the commit is recorded where the results are committed
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        except FileNotFoundError:
            commit = None
        doc = {"command": " ".join(["bench/worker_start.py", *(argv if argv is not None else sys.argv[1:])]),
               "commit": commit.stdout.strip() if commit else None, "device": device, "procs": args.procs,
               "results": results}  # fmt: skip
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
