"""What makes a committed checkpoint trustworthy on disk: every file flushed before the marker says so, the
marker listing each file's size and checksum, verification before loading, and removal that never leaves a
marker over missing files.

Which rank wrote which file: each strategy names the files only one rank writes (`rank_files`), every rank
also writes `rng/rank-N.pt`, and rank 0 owns every other file (the strategy's metadata, `trainer.json`).
Each rank flushes and checksums its own files, so the work and the reads are spread over the ranks, and
a rank only ever opens files it wrote itself or, at load, files long since closed: on a shared filesystem
with close-to-open consistency (NFS) that is what is guaranteed to be visible. An `fsync` from any client
commits a file on the server, and on one node the page cache is shared, so the owner's `fsync` suffices on
both kinds of storage the docs list.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable
from pathlib import Path

from sharded_api.contract import MARKER

CHUNK = 8 << 20
RNG_DIR = "rng"


def rng_file(rank: int) -> str:
    return f"{RNG_DIR}/rank-{rank}.pt"


def checksum(path: Path) -> tuple[int, int]:
    """(size, crc32) of a file, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def owned_files(directory: Path, rank: int, world: int, rank_pattern) -> list[Path]:
    """The files of `directory` this rank wrote: its strategy files and RNG state; rank 0 also every file
    no other rank's pattern claims."""
    mine = set(directory.glob(rank_pattern(rank))) | {directory / rng_file(rank)}
    if rank == 0:
        others = {p for r in range(1, world) for p in directory.glob(rank_pattern(r))}
        others |= {directory / rng_file(r) for r in range(1, world)}
        mine |= {p for p in directory.rglob("*") if p.is_file() and p.name != MARKER} - others
    return sorted(p for p in mine if p.is_file())


def flush_and_describe(directory: Path, files: Iterable[Path]) -> dict[str, list[int]]:
    """fsync each file and the directories holding them; their `relative path -> [size, crc32]`."""
    described, dirs = {}, set()
    for path in files:
        fsync_path(path)
        size, crc = checksum(path)
        described[path.relative_to(directory).as_posix()] = [size, crc]
        dirs.add(path.parent)
    for d in sorted(dirs):
        fsync_path(d)
    return described


def verify(directory: Path, files: dict[str, list[int]], share: Iterable[str]) -> list[str]:
    """What is wrong with the files of `share` against the marker's list (missing, size, checksum)."""
    problems = []
    for name in share:
        entry = files[name]
        # The marker is a file on a shared claim: a name leaving the directory or an entry that is not
        # [size, crc32] makes the checkpoint unverifiable, never a crash or a read elsewhere.
        if Path(name).is_absolute() or ".." in Path(name).parts:
            problems.append(f"{name!r} is not a path inside the checkpoint")
            continue
        if not (isinstance(entry, list) and len(entry) == 2 and all(type(v) is int for v in entry)):
            problems.append(f"{name} has a malformed entry in the marker")
            continue
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        size, crc = checksum(path)
        want_size, want_crc = entry
        if size != want_size:
            problems.append(f"{name} has {size} bytes, {want_size} were written")
        elif crc != want_crc:
            problems.append(f"{name} does not match its checksum")
    return problems


def share_of(names: Iterable[str], rank: int, world: int) -> list[str]:
    """This rank's part of a verification: every world-th file, so the reads are spread over the ranks."""
    return [n for i, n in enumerate(sorted(names)) if i % world == rank]
