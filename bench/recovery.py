"""Recovery time on the local end-to-end setup, gang recreation and in-place side by side: from a fault to
training resumed, broken into phases.

    .venv/bin/python bench/recovery.py --repeat 2 --out bench/results/recovery/recovery-local.json

Runs the real control plane, the operator and the node agent (pods as real processes; root, as the e2e
tier) on 3 nodes, and one 2-node job per mode, one after the other in the same run: `gang` (no in-place
restarts: every failure recreates the gang as a new attempt) and `in-place` (`failurePolicy.inPlaceRestarts`:
torchrun restarts the workers inside the pods, a lost pod is replaced alone). Each fault in turn, while
the job trains:

- worker-crash: SIGKILL of one trainer process inside a pod (the pod itself stays);
- pod-kill: SIGKILL of one pod's processes (a crash, no goodbye);
- node-not-ready: a node's kubelet goes silent with its pod's processes frozen (a partition); the
  detection includes the job's `failurePolicy.nodeLostSeconds`;
- suspend (gang only): `runPolicy.suspend` set and, once the pods are gone, cleared; timed from the resume.

Each recovery is split at the moments the bench sees (polling the API every 0.1 s) and the trainer
logs (`METRICS` lines carry Unix times):

    detect      fault -> the operator acts: a new attempt (gang) or a pod replaced alone (in place)
    delete      -> no pod of an older attempt (gang) or the failed pod (in place) is left
    schedule    -> every pod of the attempt is bound to a node
    start       -> every pod of the attempt runs (the node agent started its processes)
    rendezvous  -> rank 0's process group is up (torchrun's c10d rendezvous and init_process_group)
    load        -> rank 0 resumed from the newest checkpoint (model built, state loaded)
    first step  -> rank 0 logged the first step after the resume

A worker crash recovered in place involves no pod: its first four phases are zero, and the rest is
torchrun's restart of every node's workers.

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
sys.path[:0] = [str(ROOT / "hack"), str(ROOT / "tests")]  # the local stack; the job factory

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


def job(name: str, in_place: bool) -> dict:
    from support.jobs import local_cpu_job

    # Enough in-place restarts for every fault of every repeat in one attempt (each costs every surviving
    # agent one); the gang mode has none, as by default.
    restarts = 20 if in_place else 0
    b = local_cpu_job(name, steps=1_000_000).spec("trainer.logEvery", 1)
    b = b.spec("checkpoint", {"volumeClaim": {"size": "1Gi"}, "interval": 5, "keepLast": 2})
    b = b.spec("failurePolicy", {"backoffLimit": 20, "nodeLostSeconds": NODE_LOST_SECONDS, "inPlaceRestarts": restarts})
    return b.spec("runPolicy", {"terminationGraceSeconds": 10}).manifest()


class Bench:
    def __init__(self, stack, name: str, in_place: bool):
        from sharded_operator.api.models import GROUP, PLURAL, VERSION

        self.stack, self.name, self.in_place = stack, name, in_place
        self.path = f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}/{name}"

    def status(self) -> dict:
        return self.stack.cluster.api("GET", self.path).get("status") or {}

    def pods(self) -> list[dict]:
        """The job's training pods (not its rendezvous store pod)."""
        from sharded_operator.api.models import LABEL_INDEX, LABEL_JOB

        url = f"/api/v1/namespaces/{NS}/pods?labelSelector={LABEL_JOB}%3D{self.name},{LABEL_INDEX}"
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

        from sharded_operator.api.status import ShardedTrainingJobStatus

        def step() -> int:
            s = ShardedTrainingJobStatus.model_validate(self.status())
            return s.progress.step if s.progress and s.last_checkpoint else 0

        self.wait(lambda: step() > past_step + 6, "training")
        return step()

    def log_of(self, pod: dict) -> str:
        run = self.stack.agent.runs.get(pod["metadata"]["uid"])
        path = run.workdir / "container.log" if run else None
        return path.read_text() if path and path.exists() else ""

    def measure(self, fault: float, before: dict, victim: str | None) -> dict[str, float]:
        """Poll until training resumes after the fault; the time each phase ended. `before` is the status
        before the fault; `victim` the UID of the pod the fault hit (None: no pod is replaced)."""
        from sharded_operator.api.models import LABEL_ATTEMPT

        marks = {"fault": fault}
        old_attempt, replaced = before["attempt"], before.get("podReplacements", 0)
        deadline = time.monotonic() + 300
        while "first step" not in marks:
            if time.monotonic() > deadline:
                raise TimeoutError(f"recovery not complete: {marks}")
            now, status, pods = time.time(), self.status(), self.pods()
            attempt = status.get("attempt", 0)
            current = [p for p in pods if int(p["metadata"]["labels"][LABEL_ATTEMPT]) == attempt]
            if attempt > old_attempt or victim is None:  # a new attempt, or nothing for the operator to do
                gone = not [p for p in pods if int(p["metadata"]["labels"][LABEL_ATTEMPT]) <= old_attempt]
                acted = attempt > old_attempt
            else:  # a pod replaced alone in the same attempt
                gone = all(p["metadata"]["uid"] != victim for p in pods)
                acted = status.get("podReplacements", 0) > replaced
            seen = {  # in order: a phase ends only after the one before it
                "detect": acted or victim is None,
                "delete": (gone and acted) or victim is None,
                "schedule": len(current) == 2 and all(p["spec"].get("nodeName") for p in current),
                "start": len(current) == 2 and all(p["status"].get("phase") == "Running" for p in current),
            }
            for phase, done in seen.items():
                if phase not in marks and not done:
                    break
                marks.setdefault(phase, fault if victim is None and attempt == old_attempt else now)
            if "start" in marks:
                # rank 0 may be on any node after a new round: the first pod whose log has the whole resume
                for pod in current:
                    found = trainer_marks(self.log_of(pod), after=fault)
                    if "first step" in found:
                        marks.update(found)
                        break
            time.sleep(0.1)
        marks["attempts"] = self.status().get("attempt", 0) - old_attempt
        return marks


def run_fault(bench: Bench, kind: str) -> dict:
    from sharded_operator.api.models import LABEL_INDEX

    bench.training()
    before = bench.status()
    victim = next(p for p in bench.pods() if p["metadata"]["labels"][LABEL_INDEX] == "1")
    run = bench.stack.agent.runs[victim["metadata"]["uid"]]
    extra: dict[str, float] = {}
    in_place = bench.in_place
    if kind == "worker-crash":
        worker = bench.stack.agent.trainer_workers(run)[0]
        fault = time.time()
        os.kill(worker, signal.SIGKILL)
        # In place, torchrun restarts it in the same pod; otherwise the pod fails and the gang is recreated.
        marks = bench.measure(fault, before, None if in_place else victim["metadata"]["uid"])
    elif kind == "pod-kill":
        fault = time.time()
        os.killpg(run.proc.pid, signal.SIGKILL)
        marks = bench.measure(fault, before, victim["metadata"]["uid"])
    elif kind == "node-not-ready":
        node = victim["spec"]["nodeName"]
        fault = time.time()
        bench.stack.agent.lose_node(node, freeze=True)
        try:
            marks = bench.measure(fault, before, victim["metadata"]["uid"])
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
        marks = bench.measure(fault, bench.status(), victim["metadata"]["uid"])
    else:
        raise ValueError(kind)
    attempts = marks.pop("attempts")
    return {"mode": "in-place" if in_place else "gang", "fault": kind, "new_attempts": attempts,
            "phases": breakdown(marks), **extra}  # fmt: skip


FAULTS = {"gang": "worker-crash,pod-kill,node-not-ready,suspend", "in-place": "worker-crash,pod-kill,node-not-ready"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--modes", default="gang,in-place", help="which jobs, in this order")
    parser.add_argument("--faults", help="comma-separated; default: every fault the mode has")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)

    from localstack.stack import LocalStack

    stack = LocalStack(Path(tempfile.mkdtemp(prefix="sharded-recovery-")), nodes=3).start()
    results = []
    try:
        for mode in args.modes.split(","):
            bench = Bench(stack, f"recovery-{mode}", in_place=mode == "in-place")
            stack.cluster.api("POST", bench.path.rsplit("/", 1)[0], job(bench.name, bench.in_place))
            for i in range(args.repeat):
                for kind in (args.faults or FAULTS[mode]).split(","):
                    result = run_fault(bench, kind)
                    results.append(result)
                    print(f"[recovery] {mode} {i + 1}/{args.repeat} {json.dumps(result)}", flush=True)
            stack.cluster.api("DELETE", bench.path)
            bench.wait(lambda b=bench: not b.pods(), "the job's pods gone")
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

    rows = [
        "| mode | fault | n | new attempts | " + " | ".join(PHASES) + " | total | gang / this |",
        "| --- | --- | ---: | ---: |" + " ---: |" * (len(PHASES) + 2),
    ]
    totals: dict[tuple[str, str], float] = {}
    for mode, kind in dict.fromkeys((r.get("mode", "gang"), r["fault"]) for r in results):
        runs = [r for r in results if (r.get("mode", "gang"), r["fault"]) == (mode, kind)]
        phases = [r["phases"] for r in runs]
        totals[mode, kind] = statistics.median(r["total"] for r in phases)
        ratio = totals.get(("gang", kind), 0) / totals[mode, kind] if ("gang", kind) in totals else None
        cells = [f"{statistics.median(r[p] for r in phases):.1f}" for p in [*PHASES, "total"]]
        attempts = sorted({r.get("new_attempts", 1) for r in runs})
        rows.append(f"| {mode} | {kind} | {len(runs)} | {','.join(map(str, attempts))} | " + " | ".join(cells)
                    + f" | {f'{ratio:.2f}x' if ratio else '-'} |")  # fmt: skip
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
