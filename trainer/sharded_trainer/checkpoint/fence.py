"""Writer fencing on the checkpoint claim: every training start takes a new generation there, and only the
newest generation may commit.

A partitioned or frozen old attempt (its node lost, its pods not yet gone) can wake up after a newer
attempt has started and try to commit over it. The generation lives on the claim itself, as one empty
file per start created with O_EXCL (so two writers never take the same one, on a shared filesystem
too), which also fences across a job deleted and created again with the same retained claim.

Checking the generation before a commit is not enough on its own: a writer can stall between its check
and its rename (a hard NFS mount during a partition) and act long after a newer one started. So nothing
that replaces or removes a committed checkpoint trusts an earlier look: `install` renames over nothing
but an empty name (a rename onto a non-empty directory fails), and `take_aside` renames a directory away
first and judges what it moved by the generation its marker records, putting back a newer generation's.
Whatever a stalled writer's timing, a newer generation's checkpoint is never replaced or removed by it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from pathlib import Path

from sharded_api.contract import FENCE_DIR, MARKER

# A directory moved out of the way to be judged and removed: `step-NNNNNNNN.aside-g<mover>-<random>`.
ASIDE_INFIX = ".aside-g"

KEEP = 8  # generation files kept; older ones only say what the newest already says


def newest_generation(root: Path) -> int:
    d = root / FENCE_DIR
    if not d.is_dir():
        return 0
    return max((int(p.name) for p in d.iterdir() if p.name.isdigit()), default=0)


def claim_generation(root: Path) -> int:
    """Take the next generation: from now on, writers of older ones can no longer commit."""
    d = root / FENCE_DIR
    d.mkdir(parents=True, exist_ok=True)
    while True:
        generation = newest_generation(root) + 1
        try:
            os.close(os.open(d / f"{generation:010d}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:  # another writer took it first: take the next
            continue
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        for old in sorted(p for p in d.iterdir() if p.name.isdigit())[:-KEEP]:
            old.unlink(missing_ok=True)
        return generation


class Superseded(RuntimeError):
    """A newer writer generation's checkpoint holds the name: this writer may not replace it."""

    def __init__(self, directory: Path, newer: int):
        super().__init__(f"{directory} was committed by writer generation {newer}")
        self.directory, self.newer = directory, newer


def committed_by(directory: Path) -> int:
    """The writer generation a committed checkpoint's marker records (0: none recorded, or not readable)."""
    try:
        generation = json.loads((directory / MARKER).read_text()).get("generation")
    except (OSError, ValueError, AttributeError):
        return 0
    # Another attempt wrote it: only a plain positive integer counts (JSON `true` is no generation).
    return generation if type(generation) is int and generation > 0 else 0


def take_aside(directory: Path, generation: int) -> Path | None:
    """Move `directory` out of its name for `generation` to remove, unless a newer generation committed it:
    renamed first, then judged, so what is judged is what was moved. A newer generation's is put back (None);
    None too when there is nothing to move."""
    if committed_by(directory) > generation:
        return None  # the common case, without moving anything
    aside = directory.with_name(f"{directory.name}{ASIDE_INFIX}{generation}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(directory, aside)
    except FileNotFoundError:
        return None
    if committed_by(aside) > generation:  # it changed hands between the look and the rename
        os.rename(aside, directory)
        return None
    return aside


def install(writing: Path, directory: Path, generation: int) -> None:
    """Commit `writing` (complete, its marker inside) as `directory`, replacing an older generation's save of
    that step. Raises Superseded when a newer generation's holds the name, however late this writer is."""
    while True:
        try:
            os.rename(writing, directory)  # onto nothing (or an empty directory) only
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        aside = take_aside(directory, generation)
        if aside is None:
            if (newer := committed_by(directory)) > generation:
                raise Superseded(directory, newer)
            continue  # it went meanwhile: the name is free again
        shutil.rmtree(aside, ignore_errors=True)


def remove(directory: Path, generation: int) -> bool:
    """Remove a checkpoint for `generation`, never a newer generation's; whether it was removed."""
    aside = take_aside(directory, generation)
    if aside is None:
        return False
    shutil.rmtree(aside, ignore_errors=True)
    return True
