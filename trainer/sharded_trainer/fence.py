"""Writer fencing on the checkpoint claim: every training start takes a new generation there, and only the
newest generation may commit.

A partitioned or frozen old attempt (its node lost, its pods not yet gone) can wake up after a newer
attempt has started and try to commit over it. The generation lives on the claim itself, as one empty
file per start created with O_EXCL (so two writers never take the same one, on a shared filesystem
too), which also fences across a job deleted and created again with the same retained claim.
"""

from __future__ import annotations

import os
from pathlib import Path

from sharded_trainer.contract import FENCE_DIR

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
