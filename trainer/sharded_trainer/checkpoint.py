"""Checkpoints on the shared volume: one directory per step, committed by a marker written last.

Layout (names in `contract`) of `<root>/step-00000040/`: the strategy's state (its own format),
`trainer.json` (step, data position, world size), `rng/rank-N.pt`, and finally the `COMMITTED` marker.
A directory without the marker (a crash mid-save, a pod killed while writing) is never loaded and is
swept away by the next save, so the newest committed checkpoint always survives.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from sharded_trainer.config import CheckpointConfig
from sharded_trainer.contract import MARKER, TRAINER_STATE, iso, parse_step_dir, step_dir_name
from sharded_trainer.process_group import DistEnv


def step_dir(root: Path, step: int) -> Path:
    return root / step_dir_name(step)


def is_committed(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def committed_steps(root: Path) -> list[int]:
    """Steps with a committed checkpoint under `root`, oldest first."""
    if not root.is_dir():
        return []
    steps = [parse_step_dir(d.name) for d in root.iterdir() if is_committed(d)]
    return sorted(s for s in steps if s is not None)


def newest_committed(root: Path) -> Path | None:
    steps = committed_steps(root)
    return step_dir(root, steps[-1]) if steps else None


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Pending:
    """An asynchronous save whose marker is written once every rank's write has finished."""

    step: int
    future: object
    trainer_state: dict


class CheckpointManager:
    """`save(step)` decides itself whether to save; `load_latest()` restores the newest committed step."""

    def __init__(
        self, cfg: CheckpointConfig, env: DistEnv, total_steps: int, *, on_commit: Callable[[dict], None] | None = None
    ):
        """`on_commit` is told of each committed checkpoint ({step, path, time}) on every rank."""
        self.cfg, self.env, self.total_steps = cfg, env, total_steps
        self.on_commit = on_commit
        self.root = Path(cfg.dir) if cfg.dir else None
        self.pending: Pending | None = None
        self.last_committed: dict | None = None

    @property
    def enabled(self) -> bool:
        return self.root is not None

    def should_save(self, step: int, *, force: bool = False) -> bool:
        return self.enabled and (force or step % self.cfg.interval == 0 or step == self.total_steps)

    def save(self, step: int, strategy, trainer_state: dict, *, force: bool = False) -> bool:
        """Save at `step` if the policy says so (or `force`); returns whether a save was started."""
        if not self.should_save(step, force=force):
            return False
        assert self.root is not None
        self.wait()  # at most one save in flight: the previous one commits before the next starts
        directory = step_dir(self.root, step)
        if self.env.is_main:
            if directory.exists():  # an uncommitted leftover of a crashed attempt at this step
                shutil.rmtree(directory)
            (directory / "rng").mkdir(parents=True)
        dist.barrier()
        torch.save(torch.get_rng_state(), directory / "rng" / f"rank-{self.env.rank}.pt")
        async_save = self.cfg.async_save and not force and step != self.total_steps
        future = strategy.save(directory, async_save=async_save)
        state = {**trainer_state, "step": step, "world": self.env.world}
        if future is None:
            self._commit(step, state)
        else:
            self.pending = Pending(step, future, state)
        return True

    def wait(self) -> None:
        """Block until an in-flight asynchronous save is committed."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        pending.future.result()
        self._commit(pending.step, pending.trainer_state)

    def _commit(self, step: int, state: dict) -> None:
        assert self.root is not None
        dist.barrier()  # every rank's shards are on disk before the marker says so
        directory = step_dir(self.root, step)
        committed_at = iso()
        if self.env.is_main:
            _write_atomic(directory / TRAINER_STATE, json.dumps(state, indent=2).encode())
            _fsync_dir(directory)
            marker = {"step": step, "time": committed_at}
            _write_atomic(directory / MARKER, json.dumps(marker).encode())
            _fsync_dir(directory)
            self._purge()
        self.last_committed = {"step": step, "path": str(directory), "time": committed_at}
        dist.barrier()
        if self.on_commit:
            self.on_commit(self.last_committed)

    def _purge(self) -> None:
        """Keep the newest `keep_last` committed checkpoints; drop older ones and stale partial saves."""
        assert self.root is not None
        steps = committed_steps(self.root)
        keep = set(steps[-self.cfg.keep_last :])
        newest = steps[-1] if steps else -1
        for d in self.root.iterdir():
            s = parse_step_dir(d.name)
            if s is None:
                continue
            committed = is_committed(d)
            if (committed and s not in keep) or (not committed and s < newest):
                shutil.rmtree(d, ignore_errors=True)

    def load_latest(self, strategy) -> dict | None:
        """Restore the newest committed checkpoint into `strategy`; returns its trainer state, or None."""
        if not self.enabled or not self.cfg.resume:
            return None
        assert self.root is not None
        directory = newest_committed(self.root)
        if directory is None:
            return None
        strategy.load(directory)
        state = json.loads((directory / TRAINER_STATE).read_text())
        rng = directory / "rng" / f"rank-{self.env.rank}.pt"
        # RNG streams are per rank: restore them only when the world is the same shape.
        if state.get("world") == self.env.world and rng.is_file():
            torch.set_rng_state(torch.load(rng, weights_only=True))
        committed_at = json.loads((directory / MARKER).read_text()).get("time")
        self.last_committed = {"step": state["step"], "path": str(directory), "time": committed_at}
        return state
