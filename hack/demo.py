"""`make demo`: the CPU quickstart end to end on this machine.

Starts the local control plane, a node agent that runs pods as real processes, and the operator;
applies examples/quickstart-cpu.yaml (2 nodes x 2 processes, FSDP2, gloo); shows progress as it
trains; prints the final status and the checkpoint tree. `--keep` leaves everything up for kubectl.
`--containers` builds the operator and trainer images (hack/images.py) and runs each pod in a container
of the trainer image, as uid 1000 with the claim's fsGroup, instead of as a process.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import time
from pathlib import Path

import yaml

import localcluster
from localstack import ROOT, LocalStack
from nodeagent import can_isolate
from sharded_operator.models import (
    FINISHED,
    GROUP,
    PLURAL,
    VERSION,
    Phase,
    Progress,
    ShardedTrainingJobStatus,
)


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def tree(path: Path, limit: int = 40) -> list[str]:
    lines = []
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path)
        size = f"  ({p.stat().st_size} bytes)" if p.is_file() else "/"
        lines.append(f"  {'  ' * (len(rel.parts) - 1)}{rel.name}{size}")
    return lines[:limit] + ([f"  ... {len(lines) - limit} more"] if len(lines) > limit else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", action="store_true", help="keep the cluster, agent and operator up afterwards")
    parser.add_argument("--example", default=str(ROOT / "examples" / "quickstart-cpu.yaml"))
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--containers", action="store_true", help="run the pods in containers of the trainer image")
    args = parser.parse_args(argv)
    if not can_isolate():
        say("the demo runs each pod in its own network namespace: run it as root with iproute2 (ip) installed")
        return 2

    workdir = ROOT / ".cluster"
    localcluster.stop_dir(workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    job = yaml.safe_load(Path(args.example).read_text())
    if args.containers:
        import images

        say("building the images from the repo's Dockerfiles (cached after the first time) ...")
        job["spec"]["image"] = images.build_all()["trainer"]
    say("starting the local control plane, 2 local nodes and the operator ...")
    stack = LocalStack(workdir, containers=args.containers).start()
    ok = False
    name, ns = job["metadata"]["name"], "default"
    try:
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}"
        stack.cluster.api("POST", path, job)
        spec = job["spec"]
        say(f"applied {Path(args.example).name}: {spec['nodes']} nodes, strategy {spec['strategy']['type']}")
        started, last = time.monotonic(), None
        raw: dict = {}
        status = ShardedTrainingJobStatus()
        while time.monotonic() - started < args.timeout:
            raw = stack.cluster.api("GET", f"{path}/{name}").get("status", {})
            status = ShardedTrainingJobStatus.model_validate(raw)
            prog, ck = status.progress or Progress(), status.last_checkpoint
            line = (
                f"phase={status.phase}  ready={status.ready}  step={prog.step}/{prog.total_steps or '-'}  "
                f"loss={prog.loss if prog.loss is not None else '-'}  tokens/s={prog.tokens_per_second or '-'}  "
                f"checkpoint={ck.step if ck else '-'}  restarts={status.restarts}"
            )
            if line != last:  # print only what changed
                print(f"{time.monotonic() - started:5.0f}s  {line}", flush=True)
                last = line
            if status.phase in FINISHED:
                break
            time.sleep(1)
        say("final status:")
        print(yaml.safe_dump(raw, sort_keys=False), flush=True)
        claim = f"{name}-checkpoints"
        ckpt = stack.claim_dir(ns, claim) / name
        say(f"checkpoints on claim {claim} ({ckpt}):")
        print("\n".join(tree(ckpt)), flush=True)
        ok = status.phase == Phase.SUCCEEDED
        if not ok:
            for log in sorted((workdir / "nodeagent" / "pods").glob("*/container.log")):
                say(f"--- {log.parent.name} ---")
                print(log.read_text()[-2000:])
        if args.keep:
            say(f"cluster kept up: export KUBECONFIG={stack.cluster.kubeconfig}")
            say(f"                 export PATH={stack.cluster.bin_dir}:$PATH; kubectl get stj,pods")
            say("press Ctrl-C to stop everything")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    finally:
        # Delete the job while the operator runs, so its finalizer is released, then stop everything.
        with contextlib.suppress(Exception):  # already gone
            stack.cluster.api("DELETE", f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}/{name}")
            time.sleep(2)
        stack.stop()
        say("stopped the cluster, the node agent and the operator")
    say("demo " + ("succeeded" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
