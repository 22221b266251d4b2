"""Recovery time on the local end-to-end setup: from a fault to training resumed, broken into phases.

    .venv/bin/python bench/recovery.py --repeat 2 --out bench/results/recovery-local.json

Runs the real control plane, the operator and the node agent (pods as real processes; root, as the e2e
tier), one 2-node job on 3 nodes, and injects each fault in turn while it trains:

- pod-kill: SIGKILL of one pod's processes (a crash, no goodbye);
- node-not-ready: a node's kubelet goes silent with its pod's processes frozen (a partition); the
  detection includes the job's `failurePolicy.nodeLostSeconds`;
- suspend: `runPolicy.suspend` set and, once the pods are gone, cleared; timed from the resume.

Each recovery is split at the moments the bench sees (polling the API every 0.1 s) and the trainer
logs (`METRICS` lines carry Unix times):

    detect      fault -> the operator starts a new attempt (status.attempt goes up)
    delete      -> no pod of an older attempt is left
    schedule    -> every pod of the new attempt is bound to a node
    start       -> every pod of the new attempt runs (the node agent started its processes)
    rendezvous  -> rank 0's process group is up (torchrun's c10d rendezvous and init_process_group)
    load        -> rank 0 resumed from the newest checkpoint (model built, state loaded)
    first step  -> rank 0 logged the first step after the resume

Absolute times are this machine's (2 CPU cores, a tiny model); what carries over is which phase
dominates. Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "hack"))

PHASES = ["detect", "delete", "schedule", "start", "rendezvous", "load", "first step"]
NS = "default"
NODE_LOST_SECONDS = 10


def breakdown(marks: dict[str, float]) -> dict[str, float]:
    """Seconds spent in each phase, from the time each phase ended (`marks`, with `fault` the start)."""
    out, previous = {}, marks["fault"]
    for phase in PHASES:
        out[phase] = round(marks[phase] - previous, 3)
        previous = marks[phase]
    out["total"] = round(marks[PHASES[-1]] - marks["fault"], 3)
    return out


def trainer_marks(log: str, after: float) -> dict[str, float]:
    """When rank 0's process group came up, it resumed, and it logged its first step, from its METRICS lines
    written after `after` (an earlier attempt's lines are in the same log only if the pod is reused)."""
    marks: dict[str, float] = {}
    for line in log.splitlines():
        if not line.startswith("METRICS "):
            continue
        rec = json.loads(line[len("METRICS ") :])
        t = rec.get("time", 0)
        if t < after:
            continue
        if rec.get("event") == "started":
            marks.setdefault("rendezvous", t)
        elif rec.get("event") == "resumed":
            marks.setdefault("load", t)
        elif "event" not in rec and "load" in marks:
            marks.setdefault("first step", t)
    return marks


def job(name: str) -> dict:
    from sharded_operator.models import GROUP, VERSION

    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ShardedTrainingJob",
        "metadata": {"name": name},
        "spec": {
            "image": "sharded-training/trainer:0.1.0",
            "nodes": 2,
            "procsPerNode": 2,
            "strategy": {"type": "fsdp"},
            "trainer": {"model": {"preset": "tiny"}, "steps": 1_000_000, "microBatchSize": 4, "seqLen": 64,
                        "precision": "fp32", "optimizer": {"lr": 0.01}, "logEvery": 1},
            "resources": {"cpu": 1, "memory": "2Gi"},
            "checkpoint": {"volumeClaim": {"size": "1Gi"}, "interval": 5, "keepLast": 2},
            "failurePolicy": {"backoffLimit": 10, "nodeLostSeconds": NODE_LOST_SECONDS},
            "runPolicy": {"terminationGraceSeconds": 10},
        },
    }  # fmt: skip


class Bench:
    def __init__(self, stack, name: str):
        from sharded_operator.models import GROUP, PLURAL, VERSION

        self.stack, self.name = stack, name
        self.path = f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}/{name}"

    def status(self) -> dict:
        return self.stack.cluster.api("GET", self.path).get("status") or {}

    def pods(self) -> list[dict]:
        from sharded_operator.models import LABEL_JOB

        url = f"/api/v1/namespaces/{NS}/pods?labelSelector={LABEL_JOB}%3D{self.name}"
        return self.stack.cluster.api("GET", url)["items"]

    def wait(self, pred, what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            time.sleep(0.1)
        raise TimeoutError(f"{what} after {timeout}s")

    def training(self, past_step: int = 0) -> int:
        """Wait until the job trains past `past_step` with a checkpoint behind it; returns the step."""
        def ok():
            s = self.status()
            return (s.get("progress") or {}).get("step", 0) > past_step + 6 and s.get("lastCheckpoint")

        self.wait(ok, "training")
        return self.status()["progress"]["step"]

    def log_of(self, pod: dict) -> str:
        run = self.stack.agent.runs.get(pod["metadata"]["uid"])
        path = run.workdir / "container.log" if run else None
        return path.read_text() if path and path.exists() else ""

    def measure(self, fault: float, old_attempt: int) -> dict[str, float]:
        """Poll until the new attempt logs its first step; the time each phase ended."""
        from sharded_operator.models import LABEL_ATTEMPT

        marks = {"fault": fault}
        deadline = time.monotonic() + 300
        while "first step" not in marks:
            if time.monotonic() > deadline:
                raise TimeoutError(f"recovery not complete: {marks}")
            now, status, pods = time.time(), self.status(), self.pods()
            attempt = status.get("attempt", 0)
            old = [p for p in pods if int(p["metadata"]["labels"][LABEL_ATTEMPT]) <= old_attempt]
            new = [p for p in pods if int(p["metadata"]["labels"][LABEL_ATTEMPT]) == attempt > old_attempt]
            seen = {  # in order: a phase ends only after the one before it
                "detect": attempt > old_attempt,
                "delete": not old,
                "schedule": len(new) == 2 and all(p["spec"].get("nodeName") for p in new),
                "start": len(new) == 2 and all(p["status"].get("phase") == "Running" for p in new),
            }
            for phase, done in seen.items():
                if phase not in marks and not done:
                    break
                marks.setdefault(phase, now)
            if "start" in marks:
                for pod in new:
                    found = trainer_marks(self.log_of(pod), after=marks["start"] - 1)
                    if "first step" in found:
                        marks.update(found)
            time.sleep(0.1)
        return marks


def run_fault(bench: Bench, kind: str) -> dict:
    from sharded_operator.models import LABEL_INDEX

    bench.training()
    status = bench.status()
    attempt = status["attempt"]
    victim = next(p for p in bench.pods() if p["metadata"]["labels"][LABEL_INDEX] == "1")
    extra: dict[str, float] = {}
    if kind == "pod-kill":
        run = bench.stack.agent.runs[victim["metadata"]["uid"]]
        fault = time.time()
        os.killpg(run.proc.pid, signal.SIGKILL)
        marks = bench.measure(fault, attempt)
    elif kind == "node-not-ready":
        node = victim["spec"]["nodeName"]
        fault = time.time()
        bench.stack.agent.lose_node(node, freeze=True)
        try:
            marks = bench.measure(fault, attempt)
        finally:
            bench.stack.agent.restore_node(node)  # its frozen processes are killed: their pod is gone
    elif kind == "suspend":
        patch = {"spec": {"runPolicy": {"suspend": True}}}
        asked = time.time()
        bench.stack.cluster.api("PATCH", bench.path, patch, "application/merge-patch+json")
        bench.wait(lambda: bench.status().get("phase") == "Suspended" and not bench.pods(), "suspended")
        extra["stop (suspend -> pods gone, final checkpoint)"] = round(time.time() - asked, 3)
        fault = time.time()
        patch["spec"]["runPolicy"]["suspend"] = False
        bench.stack.cluster.api("PATCH", bench.path, patch, "application/merge-patch+json")
        marks = bench.measure(fault, attempt)
    else:
        raise ValueError(kind)
    return {"fault": kind, "phases": breakdown(marks), **extra}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--faults", default="pod-kill,node-not-ready,suspend")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)

    from localstack import LocalStack

    stack = LocalStack(Path(tempfile.mkdtemp(prefix="sharded-recovery-")), nodes=3).start()
    results = []
    try:
        bench = Bench(stack, "recovery")
        stack.cluster.api("POST", bench.path.rsplit("/", 1)[0], job(bench.name))
        for i in range(args.repeat):
            for kind in args.faults.split(","):
                result = run_fault(bench, kind)
                results.append(result)
                print(f"[recovery] {i + 1}/{args.repeat} {json.dumps(result)}", flush=True)
    finally:
        stack.stop()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    doc = {
        "command": " ".join(["bench/recovery.py", *(argv if argv is not None else sys.argv[1:])]),
        "commit": commit.stdout.strip(),
        "nodeLostSeconds": NODE_LOST_SECONDS,
        "results": results,
    }
    print(table(results))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def table(results: list[dict]) -> str:
    """A markdown table: one row per fault, the median of each phase over the repeats."""
    import statistics

    rows = ["| fault | n | " + " | ".join(PHASES) + " | total |", "| --- | ---: |" + " ---: |" * (len(PHASES) + 1)]
    for kind in dict.fromkeys(r["fault"] for r in results):
        runs = [r["phases"] for r in results if r["fault"] == kind]
        cells = [f"{statistics.median(r[p] for r in runs):.1f}" for p in [*PHASES, "total"]]
        rows.append(f"| {kind} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
