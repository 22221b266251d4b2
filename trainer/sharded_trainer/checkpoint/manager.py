"""Checkpoints on the shared volume: one directory per step, committed by a marker written last.

Layout (names in `contract`) of `<root>/step-00000040/`: the strategy's state (its own format),
`trainer.json` (step, data position, world size), `rng/rank-N.pt`, and finally the `COMMITTED` marker.
A save is written into `step-00000040.g<generation>/` and renamed into place at its commit, and only
the newest writer generation on the claim may commit (`fence`): an old attempt that wakes up late
writes only into its own directory and stops at its commit.

The commit (`durability`): every rank flushes the files it wrote and reports their sizes and checksums;
after the barrier, rank 0 writes the marker listing every file (atomically, then the directory), and
renames the directory into place. A directory without the marker (a crash mid-save, a pod killed while
writing, a removal interrupted) is never loaded and is swept away. At resume rank 0 chooses the
checkpoint for every rank; the ranks verify its files against the marker between them, and one that
fails, or fails to load, is set aside (renamed, kept for inspection, reported) and the next older one is
tried: a torn or corrupt checkpoint never stops a job from resuming.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from sharded_api.config import CheckpointConfig
from sharded_api.contract import (
    CORRUPT_INFIX,
    MARKER,
    TRAINER_STATE,
    WRITING_INFIX,
    iso,
    parse_step_dir,
    step_dir_name,
)
from sharded_trainer.checkpoint.durability import (
    flush_and_describe,
    fsync_path,
    owned_files,
    rng_file,
    share_of,
    verify,
)
from sharded_trainer.checkpoint.fence import (
    ASIDE_INFIX,
    Superseded,
    claim_generation,
    committed_by,
    install,
    newest_generation,
    remove,
)
from sharded_trainer.process_group import DistEnv


class Fenced(RuntimeError):
    """A newer writer generation started on the claim: this one must not commit."""


class Incompatible(RuntimeError):
    """The newest checkpoint was written for another model or layout than this run's."""


def differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """`path: saved -> current` for each field two fingerprints disagree on."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a} -> {b}")
    return out


def step_dir(root: Path, step: int) -> Path:
    return root / step_dir_name(step)


def is_committed(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def committed_steps(root: Path) -> list[int]:
    """Steps with a committed checkpoint under `root`, oldest first: by the writer generation that committed
    them, then by step. The newest generation resumed from what was there when it started; a checkpoint an
    older, stalled writer committed after that (even of a later step) is of a line training left behind."""
    if not root.is_dir():
        return []
    found = [(committed_by(d), s) for d in root.iterdir() if (s := parse_step_dir(d.name)) is not None
             and is_committed(d)]  # fmt: skip
    return [s for _, s in sorted(found)]


def newest_committed(root: Path) -> Path | None:
    steps = committed_steps(root)
    return step_dir(root, steps[-1]) if steps else None


def saved_strategy(directory: Path) -> str | None:
    """The strategy.type that wrote a committed checkpoint (from its fingerprint), if it says."""
    try:
        state = json.loads((directory / TRAINER_STATE).read_text())
    except (OSError, ValueError):
        return None
    fingerprint = state.get("fingerprint") if isinstance(state, dict) else None
    kind = fingerprint.get("strategy") if isinstance(fingerprint, dict) else None
    return kind if kind in ("fsdp", "zero2") else None


def resolve_step_dir(path: str) -> Path:
    """`path` itself if it is a committed checkpoint, else the newest committed checkpoint under it."""
    p = Path(path)
    if is_committed(p):
        return p
    newest = newest_committed(p)
    if newest is None:
        raise FileNotFoundError(f"no committed checkpoint in {p}")
    return newest


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class Pending:
    """An asynchronous save whose marker is written once every rank's write has finished."""

    step: int
    future: object
    trainer_state: dict


class CheckpointManager:
    """`save(step)` decides itself whether to save; `load_latest()` restores the newest committed step."""

    def __init__(
        self, cfg: CheckpointConfig, env: DistEnv, total_steps: int, *, on_commit: Callable[[dict], None] | None = None,
        on_set_aside: Callable[[dict], None] | None = None, fingerprint: dict | None = None,
    ):  # fmt: skip
        """`on_commit` is told of each committed checkpoint ({step, path, time}) on every rank, `on_set_aside`
        of each one set aside at resume ({step, path, reason}) on rank 0. `fingerprint` says what can resume
        from this run's checkpoints; a checkpoint with another one is not loaded."""
        self.cfg, self.env, self.total_steps = cfg, env, total_steps
        self.fingerprint = fingerprint or {}
        self.on_commit, self.on_set_aside = on_commit, on_set_aside
        self._rank_files: Callable[[int], str] | None = None
        self.root = Path(cfg.dir) if cfg.dir else None
        self.pending: Pending | None = None
        self.last_committed: dict | None = None
        self.generation = 0
        if self.root is not None:  # training starts: take the claim's next generation, on every rank
            taken = [claim_generation(self.root) if env.is_main else None]
            dist.broadcast_object_list(taken, src=0)
            self.generation = int(taken[0])
            if env.is_main:  # what a crash left behind: removals interrupted half way, partial saves
                # An older generation's save in progress is left alone here: its writer may be a live zombie
                # that has yet to reach its fence, and a swept directory would crash it rather than fence it.
                self._purge(sweep_writing=False)

    def _writing_dir(self, step: int) -> Path:
        assert self.root is not None
        return self.root / f"{step_dir_name(step)}{WRITING_INFIX}{self.generation}"

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
        directory = self._writing_dir(step)
        if self.env.is_main:
            if directory.exists():  # this generation's own leftover: a save at this step that failed
                shutil.rmtree(directory)
            (directory / "rng").mkdir(parents=True)
        dist.barrier()
        self._rank_files = strategy.rank_files
        async_save = self.cfg.async_save and not force and step != self.total_steps
        with self._fenced_if_swept(step):
            torch.save(torch.get_rng_state(), directory / rng_file(self.env.rank))
            future = strategy.save(directory, async_save=async_save)
        state = {**trainer_state, "step": step, "world": self.env.world, "fingerprint": self.fingerprint}
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
        with self._fenced_if_swept(pending.step):
            pending.future.result()
        self._commit(pending.step, pending.trainer_state)

    @contextlib.contextmanager
    def _fenced_if_swept(self, step: int):
        """A save that fails while a newer generation has started on the claim was swept away by it (it
        removes older generations' saves once it commits): that writer is fenced, not broken."""
        try:
            yield
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            assert self.root is not None
            if (newest := newest_generation(self.root)) > self.generation:
                raise self._fenced(newest, step) from e
            raise

    def _fenced(self, newest: int, step: int) -> Fenced:
        return Fenced(
            f"generation {newest} started on {self.root} after this writer's {self.generation}: "
            f"the save of step {step} is not committed"
        )

    def _commit(self, step: int, state: dict) -> None:
        assert self.root is not None and self._rank_files is not None
        writing, directory = self._writing_dir(step), step_dir(self.root, step)
        with self._fenced_if_swept(step):
            if self.env.is_main:  # rank 0's own file, flushed and listed with the rest
                _write_atomic(writing / TRAINER_STATE, json.dumps(state, indent=2).encode())
            mine = flush_and_describe(writing, owned_files(writing, self.env.rank, self.env.world, self._rank_files))
        described: list[dict | None] = [None] * self.env.world
        dist.all_gather_object(described, mine)  # also the barrier: every rank's files are on disk
        newest = [newest_generation(self.root) if self.env.is_main else None]
        dist.broadcast_object_list(newest, src=0)
        if int(newest[0]) > self.generation:
            raise self._fenced(int(newest[0]), step)
        committed_at = iso()
        if self.env.is_main:
            files = {name: entry for part in described for name, entry in (part or {}).items()}
            marker = {"step": step, "time": committed_at, "generation": self.generation, "files": files}
            _write_atomic(writing / MARKER, json.dumps(marker).encode())
            fsync_path(writing)
            try:  # over an older save at this step, committed or not; never over a newer generation's
                install(writing, directory, self.generation)
            except Superseded as e:
                raise self._fenced(e.newer, step) from None
            fsync_path(self.root)
            self._purge()
        self.last_committed = {"step": step, "path": str(directory), "time": committed_at}
        dist.barrier()
        if self.on_commit:
            self.on_commit(self.last_committed)

    def _purge(self, sweep_writing: bool = True) -> None:
        """Keep the newest `keep_last` committed checkpoints; drop older ones, stale partial saves and (after
        a commit, when `sweep_writing`) older generations' saves that never committed."""
        assert self.root is not None
        steps = committed_steps(self.root)
        keep = set(steps[-self.cfg.keep_last :])
        newest = steps[-1] if steps else -1
        for d in self.root.iterdir():
            s = parse_step_dir(d.name)
            if s is None:
                if sweep_writing:
                    self._purge_writing(d)
                if ASIDE_INFIX in d.name and committed_by(d) <= self.generation:
                    shutil.rmtree(d, ignore_errors=True)  # moved aside to be removed, then interrupted
                continue
            committed = is_committed(d)
            if committed and s not in keep:
                remove(d, self.generation)  # a newer generation's is never this writer's to remove
            elif not committed and s < newest:
                shutil.rmtree(d, ignore_errors=True)

    def _purge_writing(self, d: Path) -> None:
        """Saves older generations never committed: they can only be a fenced writer's."""
        name, _, generation = d.name.rpartition(WRITING_INFIX)
        if parse_step_dir(name) is not None and generation.isdigit() and int(generation) < self.generation:
            shutil.rmtree(d, ignore_errors=True)

    def load_latest(self, strategy) -> dict | None:
        """Restore the newest committed checkpoint that verifies and loads into `strategy`, setting aside
        each newer one that does not; returns its trainer state, or None."""
        if not self.enabled or not self.cfg.resume:
            return None
        assert self.root is not None
        # Rank 0 alone lists the claim: on a network filesystem with caching, ranks may see different newest.
        candidates = list(reversed(committed_steps(self.root))) if self.env.is_main else []
        dirty = False  # a load failed part way: the state may hold some of that checkpoint
        while True:
            chosen = [(candidates.pop(0) if candidates else None) if self.env.is_main else None]
            dist.broadcast_object_list(chosen, src=0)
            if chosen[0] is None:
                if dirty:  # nothing older overwrote it: the next attempt starts clean, without that checkpoint
                    raise RuntimeError(f"no checkpoint under {self.root} loads; the ones that failed are set aside")
                return None
            directory = step_dir(self.root, int(chosen[0]))
            state, problems = self._check(directory)
            if not problems:
                try:
                    strategy.load(directory)
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as e:
                    # A checkpoint from before checksums, say: its load is its check.
                    problems = [f"loading failed on rank {self.env.rank}: {type(e).__name__}: {e}"[:500]]
                problems = self._gathered(problems)
                dirty = dirty or bool(problems)
            if not problems:
                break
            self._set_aside(directory, problems)
        assert state is not None
        rng = directory / rng_file(self.env.rank)
        # RNG streams are per rank: restore them only when the world is the same shape.
        if state.get("world") == self.env.world and rng.is_file():
            torch.set_rng_state(torch.load(rng, weights_only=True))
        committed_at = json.loads((directory / MARKER).read_text()).get("time")
        self.last_committed = {"step": state["step"], "path": str(directory), "time": committed_at}
        return state

    def _check(self, directory: Path) -> tuple[dict | None, list[str]]:
        """The checkpoint's trainer state and what is wrong with it, agreed by every rank. An incompatible
        checkpoint raises `Incompatible`: it is not corrupt, and is never set aside."""
        problems: list[str] = []
        state: dict | None = None
        try:
            state = json.loads((directory / TRAINER_STATE).read_text())
            marker = json.loads((directory / MARKER).read_text())
            if not isinstance(state, dict) or not isinstance(marker, dict) or "step" not in state:
                raise ValueError("not a JSON object with a step")
        except (OSError, ValueError) as e:
            problems.append(f"{TRAINER_STATE} or {MARKER} unreadable: {e}"[:500])
        problems = self._gathered(problems)
        if problems:
            return None, problems
        assert state is not None
        saved = state.get("fingerprint", self.fingerprint)  # checkpoints from before fingerprints load as they are
        if not isinstance(saved, dict):  # a file on a shared claim: anything may be in it
            saved = {"fingerprint": f"unreadable ({type(saved).__name__})"}
        # ZeRO-2 checkpoints once recorded the world size they could load at; every world loads them now.
        saved = {k: v for k, v in saved.items() if k != "world"}
        if diff := differences(saved, self.fingerprint):
            raise Incompatible(f"checkpoint {directory} cannot be resumed by this run: {'; '.join(diff)}")
        files = marker.get("files")
        if isinstance(files, dict):  # written with checksums: the ranks check the files between them
            problems = verify(directory, files, share_of(files, self.env.rank, self.env.world))
        return state, self._gathered(problems)

    def _gathered(self, problems: list[str]) -> list[str]:
        every: list[list[str] | None] = [None] * self.env.world
        dist.all_gather_object(every, problems)
        return [p for part in every for p in (part or [])]

    def _set_aside(self, directory: Path, problems: list[str]) -> None:
        """Rename a checkpoint that cannot be resumed out of the way, keeping it for inspection."""
        assert self.root is not None
        step = parse_step_dir(directory.name)
        reason = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        if self.env.is_main:
            aside = self.root / f"{directory.name}{CORRUPT_INFIX}{self.generation}"
            os.replace(directory, aside)
            fsync_path(self.root)
            if self.on_set_aside:
                self.on_set_aside({"step": step, "path": str(aside), "reason": reason})
        dist.barrier()
