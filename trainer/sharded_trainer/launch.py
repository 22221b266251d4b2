"""A pod's entry point: validate the config, wait for the rendezvous endpoint, run torchrun, report.

    python -m sharded_trainer.launch --config FILE [-- script.py args...]

torchrun reads its arguments from the PET_* variables the operator sets. Before starting it, every
node waits (bounded) until the rendezvous host resolves and, on nodes other than 0, accepts TCP
connections: the DNS and connect races at start-up are the most reported failure of multi-node jobs.
The exit code is the workers' own where they agree (2: invalid config, 75: stopped after a final
checkpoint), because torchrun itself reports any worker failure as 1.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sharded_trainer.config import ConfigError, load_config
from sharded_trainer.contract import ExitCode, PodEnv, WorkerEnv


def log(msg: str) -> None:
    print(f"[launch] {msg}", file=sys.stderr, flush=True)


def wait_for_endpoint(host: str, port: int, *, connect: bool, timeout: float, interval: float = 1.0) -> bool:
    """Until `host` resolves (and, if `connect`, accepts TCP on `port`) or `timeout` passes."""
    deadline = time.monotonic() + timeout
    next_note = 0.0
    while True:
        problem, addrs = None, set()
        try:
            addrs = {a[4][0] for a in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
            if connect:
                with socket.create_connection((host, port), timeout=min(5.0, interval * 5)):
                    pass
            return True
        except socket.gaierror as e:
            problem = f"{host} does not resolve yet ({e.strerror})"
        except OSError as e:
            problem = f"{host} resolves to {', '.join(sorted(addrs))} but port {port} refuses ({e.strerror or e})"
        now = time.monotonic()
        if now >= deadline:
            log(f"giving up after {timeout:.0f}s: {problem}")
            return False
        if now >= next_note:
            log(f"waiting for the rendezvous endpoint: {problem}; {deadline - now:.0f}s left")
            next_note = now + 10
        time.sleep(interval)


def record_exit(code: int) -> int:
    """In a worker: leave this rank's exit code where the launcher reads it (torchrun itself only says 1)."""
    exit_dir = os.environ.get(PodEnv.EXIT_DIR)
    if exit_dir:
        rank = os.environ.get(WorkerEnv.RANK, "0")
        Path(exit_dir, f"rank-{rank}").write_text(str(code))
    return code


def exit_code(torchrun_rc: int, exit_dir: Path) -> int:
    """The pod's exit code: the workers' own where they agree, else torchrun's."""
    codes = [int(p.read_text() or "1") for p in exit_dir.glob("rank-*")]
    if ExitCode.INVALID_CONFIG in codes:
        return ExitCode.INVALID_CONFIG
    if codes and all(c == ExitCode.PREEMPTED for c in codes):
        return ExitCode.PREEMPTED
    return torchrun_rc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1 :]
    parser = argparse.ArgumentParser(prog="python -m sharded_trainer.launch", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    try:
        load_config(args.config)
    except ConfigError as e:
        log(f"error: {e}")
        return ExitCode.INVALID_CONFIG

    endpoint = os.environ.get(PodEnv.RDZV_ENDPOINT, "")
    node_rank = int(os.environ.get(PodEnv.NODE_RANK, "0"))
    timeout = float(os.environ.get(PodEnv.RDZV_TIMEOUT, "900"))
    if endpoint:
        host, _, port = endpoint.rpartition(":")
        # Node 0 hosts the c10d store: it needs its own name to resolve (torchrun checks whether the
        # endpoint is local); the others also need the store to accept connections.
        if not wait_for_endpoint(host, int(port), connect=node_rank != 0, timeout=timeout):
            return ExitCode.RENDEZVOUS_UNREACHABLE
        log(f"rendezvous endpoint {endpoint} reachable; starting torchrun as node {node_rank}")

    target = command or ["-m", "sharded_trainer", "--config", args.config]
    with tempfile.TemporaryDirectory(prefix="sharded-exit-") as exit_dir:
        env = {**os.environ, PodEnv.EXIT_DIR: exit_dir}
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *target], env=env)

        def forward(signum, _frame):  # the kubelet's SIGTERM: torchrun passes it on to the workers
            proc.send_signal(signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, forward)
        rc = proc.wait()
        code = exit_code(rc, Path(exit_dir))
    log(f"torchrun exited {rc}; exiting {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
