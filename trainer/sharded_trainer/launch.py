"""A pod's entry point: validate the config, wait for the rendezvous endpoint, run torchrun, report.

    python -m sharded_trainer.launch --config FILE [-- script.py args...]

torchrun reads its arguments from the PET_* variables the operator sets. Before starting it, every
node waits (bounded) until the rendezvous host resolves and, on nodes other than 0, accepts TCP
connections: the DNS and connect races at start-up are the most reported failure of multi-node jobs.
The exit code is the workers' own where they agree (2: invalid config, 75: stopped after a final
checkpoint), because torchrun itself reports any worker failure as 1.

SIGTERM is handled at any moment, as PID 1 of a container must (the kernel drops signals PID 1 has no
handler for): during the wait it ends the wait (exit 75: nothing to save yet); once training runs it
goes to the workers themselves, and torchrun is told only after they have exited, because torchrun
kills its workers 30 s after its own SIGTERM whatever the pod's grace period: the final checkpoint gets
all of the grace.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from sharded_api.contract import DEFAULT_RDZV_TIMEOUT_SECONDS, STOPPING, ExitCode, PodEnv, WorkerEnv
from sharded_api.loading import ConfigError, load_config
from sharded_trainer.agent import helper, torchrun_args


def log(msg: str) -> None:
    print(f"[launch] {msg}", file=sys.stderr, flush=True)


def wait_for_endpoint(
    host: str, port: int, *, connect: bool, timeout: float, interval: float = 1.0, stop: threading.Event | None = None
) -> bool:
    """Until `host` resolves (and, if `connect`, accepts TCP on `port`), `timeout` passes, or `stop` is set."""
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
        if stop is not None and stop.is_set():
            return False
        if now >= next_note:
            log(f"waiting for the rendezvous endpoint: {problem}; {deadline - now:.0f}s left")
            next_note = now + 10
        if stop is not None:
            stop.wait(interval)
        else:
            time.sleep(interval)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's workers), from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name may hold spaces and parentheses: the parent pid follows the last ')'.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def workers(agent: int) -> list[int]:
    """torchrun's workers: its children, or, where they are forked by its fork server, the server's."""
    out = []
    for pid in children(agent):
        kind = helper(pid)
        if kind is None:
            out.append(pid)
        elif kind == "forkserver":
            out.extend(children(pid))
    return out


def adopt_orphans() -> bool:
    """Make this process the reaper of its descendants' orphans (Linux's child subreaper), as a container's
    PID 1 must be: the fork server that parents the workers may exit before it has reaped the last of them,
    and their zombies then come here instead of to the host's init."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def reap(timeout: float) -> None:
    """Wait up to `timeout` for this process's children to exit, reaping each: the workers' orphans, once
    torchrun and its fork server are gone."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for pid in children(os.getpid()):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    left.append(pid)
        if not left or time.monotonic() >= deadline:
            return
        time.sleep(0.05)


class Stop:
    """SIGTERM or SIGINT: ends the wait for the rendezvous, or goes to the workers and then to torchrun."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.torchrun: subprocess.Popen | None = None
        self.marker: Path | None = None  # tells the workers a stop is the pod's, not torchrun's restart
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def run(self, cmd: list[str], env: dict[str, str]) -> int:
        """torchrun's exit code; a stop that came just before it started still reaches its workers."""
        self.torchrun = subprocess.Popen(cmd, env=env)
        if self.requested.is_set():
            self._forward(signal.SIGTERM)
        return self.torchrun.wait()

    def _handle(self, signum, _frame) -> None:
        first = not self.requested.is_set()
        self.requested.set()
        if self.torchrun is not None and first:
            self._forward(signum)

    def _forward(self, signum: int) -> None:
        threading.Thread(target=self._stop_workers, args=(signum,), daemon=True).start()

    def _stop_workers(self, signum: int) -> None:
        assert self.torchrun is not None
        if self.marker is not None:
            self.marker.touch()
        running = workers(self.torchrun.pid)
        log(f"stopping: signal {signum} to {len(running)} workers; torchrun once they have exited")
        for pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        while any(Path(f"/proc/{pid}").exists() and pid in workers(self.torchrun.pid) for pid in running):
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            self.torchrun.send_signal(signum)


SHARE_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # torchrun's own opt-out; a pod's env may set it back
# Exits the trainer decides on, every rank alike: torchrun must not restart the workers over them (its
# in-place restarts are for failures; a restart would only decide the same again).
DECISIONS = frozenset({ExitCode.INVALID_CONFIG, ExitCode.INCOMPATIBLE_CHECKPOINT, ExitCode.PREEMPTED, ExitCode.FENCED})


def record_exit(code: int) -> int:
    """In a worker: leave this rank's exit code where the launcher reads it (torchrun itself only says 1).
    Where torchrun may restart workers in place, a decision then exits 0 to torchrun, and the launcher
    passes the recorded code on (without restarts, torchrun's failure path is left as it always was).

    A rank that stopped because another node was asked to (PEER_STOPPED: that node is being deleted or
    drained) exits as a failure to torchrun where it may restart in place, so this node's workers wait for
    the replacement at the next rendezvous round instead of ending the pod; without restarts it stops with
    its peer (75)."""
    restarts = os.environ.get(PodEnv.MAX_RESTARTS, "0")
    in_place = restarts.isdigit() and int(restarts) > 0
    peer_stopped = code == ExitCode.PEER_STOPPED
    if peer_stopped:
        code = ExitCode.PREEMPTED
    exit_dir = os.environ.get(PodEnv.EXIT_DIR)
    if exit_dir:
        rank = os.environ.get(WorkerEnv.RANK, "0")
        Path(exit_dir, f"rank-{rank}").write_text(str(code))
        if peer_stopped and in_place:
            return 1
        if code in DECISIONS and in_place:
            return ExitCode.OK
    return code


def exit_code(torchrun_rc: int, exit_dir: Path) -> int:
    """The pod's exit code: the workers' own where they agree, else torchrun's (or, when torchrun saw only
    successes, the decision some rank recorded)."""
    codes = [int(p.read_text() or "1") for p in exit_dir.glob("rank-*")]
    if ExitCode.INVALID_CONFIG in codes:
        return ExitCode.INVALID_CONFIG
    if codes and len(set(codes)) == 1:  # e.g. every rank stopped after its final checkpoint, or was fenced
        return codes[0] if codes[0] else torchrun_rc
    if torchrun_rc == 0 and any(codes):
        return max(codes)
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
    stop = Stop()
    adopt_orphans()
    try:
        load_config(args.config)
        torchrun = torchrun_args(command or ["-m", "sharded_trainer", "--config", args.config])
    except (ConfigError, ValueError) as e:
        log(f"error: {e}")
        return ExitCode.INVALID_CONFIG

    endpoint = os.environ.get(PodEnv.RDZV_ENDPOINT, "")
    node_rank = int(os.environ.get(PodEnv.NODE_RANK, "0"))
    timeout = float(os.environ.get(PodEnv.RDZV_TIMEOUT, DEFAULT_RDZV_TIMEOUT_SECONDS))
    if endpoint:
        host, _, port = endpoint.rpartition(":")
        # The c10d store is the job's store pod (no agent hosts it): every node waits until it accepts
        # connections, so torchrun's own connect timeout never races the store pod's start.
        reachable = wait_for_endpoint(host, int(port), connect=True, timeout=timeout, stop=stop.requested)
        if stop.requested.is_set():
            log("stopped while waiting for the rendezvous: nothing to save yet")
            return ExitCode.PREEMPTED
        if not reachable:
            return ExitCode.RENDEZVOUS_UNREACHABLE
        log(f"rendezvous endpoint {endpoint} reachable; starting torchrun as node {node_rank}")

    with tempfile.TemporaryDirectory(prefix="sharded-exit-") as exit_dir:
        # A process-group store per rendezvous round, hosted by rank 0's worker: the store torchrun shares
        # by default is made once and handed, unprefixed, to every in-place restart, whose workers then
        # read the addresses the dead ones published and never connect (torch 2.11, under gloo).
        env = {SHARE_STORE: "1", **os.environ, PodEnv.EXIT_DIR: exit_dir}
        stop.marker = Path(exit_dir, STOPPING)
        rc = stop.run([sys.executable, "-m", "sharded_trainer.agent", *torchrun], env)
        code = exit_code(rc, Path(exit_dir))
    # The fork server leaves with torchrun, and may leave workers it had no time to reap: they are ours now.
    reap(timeout=5)
    log(f"torchrun exited {rc}; exiting {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
