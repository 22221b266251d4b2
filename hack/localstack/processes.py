"""The local stack's processes by their pid files: stopped newest component first, whole process groups,
also those an earlier, crashed launcher left."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def stop_dir(workdir: Path) -> None:
    """Stop the processes whose pid files are under `workdir/pids`, newest component first."""
    pid_dir = workdir / "pids"
    if not pid_dir.is_dir():
        return
    order = ["kwok", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"]
    files = sorted(pid_dir.iterdir(), key=lambda p: order.index(p.name) if p.name in order else -1)
    for f in files:
        stop_pid_file(f)


def stop_pid_file(f: Path) -> None:
    """Stop the process group whose leader's pid `f` holds (SIGTERM, then SIGKILL after 10 s), and remove `f`."""
    if not f.exists():
        return
    pid = int(f.read_text())
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and alive(pid):
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    f.unlink()


def alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
    except ChildProcessError:
        pass  # not our child (started by another launcher): fall back to a signal probe
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
