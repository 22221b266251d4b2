"""`sharded` (also `kubectl stj`): submit, list, get, wait for, suspend, resume, export and read the logs of jobs.

    sharded submit -f job.yaml --wait Complete
    sharded submit --name llama --nodes 4 --gpus-per-node 8 --strategy zero2 --set trainer.steps=1000
    sharded list                      # progress at a glance: phase, ready nodes, step, loss, checkpoint
    sharded get llama -o yaml
    sharded wait llama --for condition=Complete --timeout 2h
    sharded logs llama -f             # every node's pod, merged, each line prefixed with its node
    sharded suspend llama; sharded resume llama
    sharded export llama --step 5000   # one safetensors file on the job's claim, from a sharded checkpoint
    sharded plan -f job.yaml --gpu-memory 80Gi --model ./Llama-3-8B   # peak memory per GPU, each strategy
    sharded port-forward llama 6006 --node 0   # localhost:6006 -> port 6006 of node 0's pod, via the API server

Installed as `kubectl-stj` too, so kubectl finds it as a plugin (`kubectl stj list`); the kubeconfig is
the caller's (KUBECONFIG or ~/.kube/config, or --kubeconfig).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import select
import socket
import sys
import threading
import typing
from functools import partial
from typing import Any

import yaml
from pydantic import ValidationError

from sharded_api.quantity import memory_bytes
from sharded_api.strategy import StrategyConfig
from sharded_operator.api.models import GROUP, KIND, VERSION, ShardedTrainingJobSpec
from sharded_operator.client import Client, Job, JobError
from sharded_operator.run.transport import ApiError, ConfigError, Unreachable

UNITS = {"s": 1, "m": 60, "h": 3600}


def duration(text: str) -> float:
    """Seconds from `90`, `90s`, `15m` or `2h`."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is no duration: use e.g. 90s, 15m or 2h")
    return float(m[1]) * UNITS[m[2] or "s"]


def set_path(obj: dict[str, Any], path: str, value: Any) -> None:
    """`trainer.model.preset=llama-1b` style: camelCase keys as in the manifest, values parsed as YAML."""
    *parents, leaf = path.split(".")
    for key in parents:
        obj = obj.setdefault(key, {})
        if not isinstance(obj, dict):
            raise JobError(f"--set {path}: {key} is not a mapping in this manifest")
    obj[leaf] = value


def manifest(a: argparse.Namespace) -> dict[str, Any]:
    if a.file:
        with open(a.file) if a.file != "-" else sys.stdin as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        if len(docs) != 1:
            raise JobError(f"{a.file}: expected one ShardedTrainingJob, found {len(docs)} documents")
        body = docs[0]
    else:
        if not a.name:
            raise JobError("submit needs -f FILE or --name (with the flags that describe the job)")
        body = {"metadata": {}, "spec": {"nodes": a.nodes, "procsPerNode": a.procs_per_node}}
        if a.gpus_per_node is not None:
            body["spec"]["resources"] = {"gpusPerNode": a.gpus_per_node}
        if a.image:
            body["spec"]["image"] = a.image
        if a.strategy:
            body["spec"]["strategy"] = {"type": a.strategy}
        if a.preset:
            body["spec"]["trainer"] = {"model": {"preset": a.preset}}
    body.setdefault("apiVersion", f"{GROUP}/{VERSION}")
    body.setdefault("kind", KIND)
    if a.name:
        body.setdefault("metadata", {})["name"] = a.name
    for item in a.set:
        path, sep, value = item.partition("=")
        if not sep:
            raise JobError(f"--set {item}: use PATH=VALUE, e.g. trainer.steps=1000")
        set_path(body.setdefault("spec", {}), path.removeprefix("spec."), yaml.safe_load(value))
    return body


def age(timestamp: str | None, now: dt.datetime) -> str:
    if not timestamp:
        return "-"
    seconds = int((now - dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def row(job: Job, now: dt.datetime, namespace: bool) -> list[str]:
    s, progress = job.obj.status, job.obj.status.progress
    step = "-" if progress is None else f"{progress.step}/{progress.total_steps or '?'}"
    loss = "-" if progress is None or progress.loss is None else f"{progress.loss:.4g}"
    cells = [job.name, str(s.phase or "-"), s.ready or f"0/{job.obj.spec.nodes}", job.obj.spec.strategy.type, step,
             loss, str(s.restarts), str(s.last_checkpoint.step) if s.last_checkpoint else "-",
             age(job.obj.metadata.get("creationTimestamp"), now)]  # fmt: skip
    return [job.obj.metadata.get("namespace", "")] * namespace + cells


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows])


def show(job: Job, output: str) -> str:
    obj = job.obj.model_dump(mode="json", by_alias=True, exclude_none=True)
    if output == "json":
        return json.dumps(obj, indent=2)
    if output == "yaml":
        return yaml.safe_dump(obj, sort_keys=False).rstrip()
    s = job.obj.status
    lines = [f"Name:        {job.name}", f"Phase:       {s.phase or '-'}  {s.message or ''}".rstrip(),
             f"Nodes:       {s.ready or '-'} ready (attempt {s.attempt}, restarts {s.restarts}, "
             f"disruptions {s.disruptions})"]  # fmt: skip
    if s.progress:
        p = s.progress
        held_out = f", eval loss {p.eval_loss}" if p.eval_loss is not None else ""
        lines.append(f"Progress:    step {p.step}/{p.total_steps or '?'}, loss {p.loss}{held_out}, "
                     f"{p.tokens_per_second} tok/s")  # fmt: skip
    if s.last_checkpoint:
        lines.append(f"Checkpoint:  step {s.last_checkpoint.step} at {s.last_checkpoint.path}")
    if s.export:
        lines.append(f"Export:      step {s.export.step} at {s.export.path}")
    if s.last_failure:
        lines.append(f"Last failure: {s.last_failure.reason} {s.last_failure.message}".rstrip())
    lines.append("Conditions:")
    lines += [f"  {c.type:<14} {c.status:<6} {c.reason}" for c in s.conditions]
    return "\n".join(lines)


def plan(a: argparse.Namespace) -> int:
    """The trainer's memory model for a job as its manifest (and --set) describes it: nodes, processes,
    micro-batch, seq, precision, LoRA, DPO. The model's shape comes from a preset or a local copy of its config.json."""
    from sharded_operator.render.children import trainer_config
    from sharded_trainer import autoplan, memplan  # pure Python, no torch for a model directory

    try:
        spec = ShardedTrainingJobSpec.model_validate(manifest(a).get("spec") or {})
    except ValidationError as e:
        raise JobError(f"{a.file}: {e}") from None
    trainer, gpus = spec.trainer, spec.resources.gpus_per_node
    model = a.model or (trainer.model.huggingface.path if trainer.model.huggingface else trainer.model.preset)
    try:
        shape = memplan.load_shape(model)
    except ValueError as e:
        raise JobError(f"{e}; the job's model directory is on its claim: give --model with a local copy of its "
                       "config.json") from None  # fmt: skip
    procs = spec.procs_per_node if spec.procs_per_node != "auto" else max(gpus, 1)
    # What auto plans with at the job's start: precision, compile, LoRA, NF4, DPO's reference, reduce dtype.
    job = autoplan.job_of(trainer_config(spec), spec.nodes * procs, shape)
    try:
        gpu = memory_bytes(a.gpu_memory)
    except ValueError as e:
        raise JobError(f"--gpu-memory {e}") from None
    print(autoplan.table(job, gpu))
    return 0


def forward_ports(text: str) -> tuple[int, int]:
    """(local, remote) from `[LOCAL:]REMOTE`: the local port defaults to the remote one, 0 takes any free port."""
    local, _, remote = text.rpartition(":")
    ports = [p for p in (local or remote, remote) if len(p) <= 5 and p.isascii() and p.isdigit() and int(p) < 65536]
    if len(ports) != 2 or int(remote) == 0:
        raise JobError(f"{text[:40]}: give [LOCAL:]REMOTE ports, e.g. 8888 or 18888:8888 (LOCAL 0: any free port)")
    return int(ports[0]), int(ports[1])


def port_forward(jobs: Client, a: argparse.Namespace) -> int:
    """Listen on the local port and carry each connection to the pod's port through the API server, as
    `kubectl port-forward` does; until interrupted."""
    local_port, remote_port = forward_ports(a.ports)
    pod = jobs.pod(a.name, a.node)
    jobs.port_forward(pod, remote_port).close()  # fail now, not at the first connection, if it cannot work
    server = socket.create_server((a.address, local_port))
    print(f"Forwarding from {a.address}:{server.getsockname()[1]} -> {remote_port} (pod {pod})", flush=True)

    def carry(conn: socket.socket) -> None:
        with conn:
            try:
                forward = jobs.port_forward(pod, remote_port)
            except JobError as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
                return
            upstream = forward.socket(remote_port)  # a wrapper: no context manager
            try:
                pipe(conn, upstream)
            finally:
                upstream.close()
            if forward.error(remote_port):
                print(f"error: {pod}: {forward.error(remote_port)}", file=sys.stderr, flush=True)

    with server:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=carry, args=(conn,), daemon=True).start()


def pipe(a: socket.socket, b: socket.socket) -> None:
    """Copy both ways until either side closes or resets (the pod's side resets when the pod refused)."""
    try:
        while True:
            ready, _, _ = select.select([a, b], [], [])
            for src in ready:
                data = src.recv(1 << 16)
                if not data:
                    return
                (b if src is a else a).sendall(data)
    except (ConnectionResetError, BrokenPipeError):
        return


def run(a: argparse.Namespace) -> int:
    if (a.command == "exec") != bool(a.cmd):
        raise JobError("exec runs the command after --, e.g. sharded exec NAME --node 1 -- nvidia-smi; "
                       "no other command takes one")  # fmt: skip
    if a.command == "plan":
        return plan(a)
    jobs = Client.connect(kubeconfig=a.kubeconfig, namespace=a.namespace)
    if a.command == "submit":
        job = jobs.create(manifest(a))
        print(f"shardedtrainingjob/{job.name} created")
        if a.wait:
            job = jobs.wait(job.name, condition=a.wait, timeout=a.timeout)
            print(f"shardedtrainingjob/{job.name} condition met: {a.wait}")
    elif a.command == "list":
        now = dt.datetime.now(dt.UTC)
        header = ["NAME", "PHASE", "READY", "STRATEGY", "STEP", "LOSS", "RESTARTS", "CHECKPOINT", "AGE"]
        header = ["NAMESPACE"] * a.all_namespaces + header
        print(table([row(j, now, a.all_namespaces) for j in jobs.list(all_namespaces=a.all_namespaces)], header))
    elif a.command == "get":
        print(show(jobs.get(a.name), a.output))
    elif a.command == "wait":
        kind, _, value = a.for_.partition("=")
        if kind not in ("condition", "phase") or not value:
            raise JobError(f"--for {a.for_}: use condition=NAME or phase=NAME")
        jobs.wait(a.name, timeout=a.timeout, **{kind: value})
        print(f"shardedtrainingjob/{a.name} {kind} met: {value}")
    elif a.command in ("suspend", "resume"):
        getattr(jobs, a.command)(a.name)
        print(f"shardedtrainingjob/{a.name} {'suspended' if a.command == 'suspend' else 'resumed'}")
    elif a.command == "export":
        step, where = jobs.export(a.name, step=a.step, timeout=a.timeout)
        print(f"shardedtrainingjob/{a.name} checkpoint {step} exported to {where}")
    elif a.command == "logs":
        for node, line in jobs.logs(a.name, follow=a.follow, tail=a.tail):
            print(f"[node-{node}] {line}", flush=True)
    elif a.command == "port-forward":
        return port_forward(jobs, a)
    elif a.command == "exec":
        return jobs.exec(jobs.pod(a.name, a.node), a.cmd, partial(print, end="", flush=True),
                         partial(print, end="", flush=True, file=sys.stderr))  # fmt: skip
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sharded",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 2)[2],
    )
    p.add_argument("--kubeconfig", help="kubeconfig file (default: KUBECONFIG, then ~/.kube/config, then in-cluster)")
    p.add_argument("-n", "--namespace", help="namespace (default: the kubeconfig context's, else default)")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("submit", help="create a job from a manifest or from flags")
    s.add_argument("-f", "--file", help="manifest (YAML or JSON; - for stdin)")
    s.add_argument("--name", help="job name (overrides the manifest's)")
    s.add_argument("--image", help="trainer image")
    s.add_argument("--nodes", type=int, default=1, help="pods, one per node (default 1)")
    s.add_argument("--procs-per-node", type=int, default=1, help="processes per pod (default 1)")
    s.add_argument("--gpus-per-node", type=int, help="GPUs per pod")
    strategies = typing.get_args(StrategyConfig.model_fields["type"].annotation)  # the config's own choices
    s.add_argument("--strategy", choices=strategies, help="sharding strategy (auto: the trainer picks)")
    s.add_argument("--preset", help="model preset of the bundled trainer")
    s.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                   help="any spec field, e.g. trainer.steps=1000 (repeatable)")  # fmt: skip
    s.add_argument("--wait", metavar="CONDITION", help="then wait for this condition, e.g. Complete")
    s.add_argument("--timeout", type=duration, default=3600, help="for --wait (default 1h)")
    ls = sub.add_parser("list", help="jobs with their progress")
    ls.add_argument("-A", "--all-namespaces", action="store_true")
    g = sub.add_parser("get", help="one job: progress, checkpoint, conditions")
    g.add_argument("name")
    g.add_argument("-o", "--output", choices=["text", "yaml", "json"], default="text")
    w = sub.add_parser("wait", help="until a condition is True or a phase is reached")
    w.add_argument("name")
    w.add_argument("--for", dest="for_", required=True, metavar="condition=NAME|phase=NAME")
    w.add_argument("--timeout", type=duration, default=600, help="e.g. 90s, 15m, 2h (default 10m)")
    for verb in ("suspend", "resume"):
        sub.add_parser(verb, help=f"{verb} a job (its pods are deleted / recreated; checkpoints stay)").add_argument(
            "name"
        )
    ex = sub.add_parser(
        "export",
        help="consolidate a checkpoint on the job's claim (one safetensors file; "
        "a Hugging Face directory for a Hugging Face model)",
    )
    ex.add_argument("name")
    ex.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    ex.add_argument("--timeout", type=duration, default=1800, help="e.g. 30m (default 30m)")
    pl = sub.add_parser("plan", help="peak GPU memory per strategy and option for a job, and the fastest that fits")
    pl.add_argument("-f", "--file", required=True, help="the job's manifest (- for stdin)")
    pl.add_argument("--gpu-memory", required=True, help="each GPU's memory, e.g. 80Gi or 141G")
    pl.add_argument("--model", help="a local model directory or preset, for a model on the job's claim")
    pl.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                    help="change the manifest first, e.g. trainer.microBatchSize=8")  # fmt: skip
    pl.set_defaults(name=None)
    lg = sub.add_parser("logs", help="every node's log of the current attempt, merged, prefixed by node")
    lg.add_argument("name")
    lg.add_argument("-f", "--follow", action="store_true")
    lg.add_argument("--tail", type=int, help="lines from the end of each pod's log")
    pf = sub.add_parser("port-forward", help="a local port to a port of one of the job's pods, through the API server")
    pf.add_argument("name")
    pf.add_argument("ports", help="[LOCAL:]REMOTE, e.g. 8888 or 18888:8888 (LOCAL 0: any free port)")
    pf.add_argument("--node", type=int, default=0, help="whose pod (default 0)")
    pf.add_argument("--address", default="127.0.0.1", help="local address to listen on (default 127.0.0.1)")
    xc = sub.add_parser("exec", help="run a command in one of the job's pods (as by hand in an interactive job), "
                        "through the API server; its exit code is sharded's",
                        usage="sharded exec NAME [--node N] -- COMMAND [ARG...]")  # fmt: skip
    xc.add_argument("name")
    xc.add_argument("--node", type=int, default=0, help="whose pod (default 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # `exec NAME -- COMMAND...`: every word after `--` is the command's, options included (argparse, with
    # subcommands, would still read them as sharded's).
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1 :]
    a = parser().parse_args(argv)
    a.cmd = command
    try:
        return run(a)
    except (JobError, TimeoutError, ConfigError, ApiError, Unreachable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
