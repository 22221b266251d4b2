"""Giving memory freed after a burst of work back to the system.

A burst of job starts parses thousands of watch events and API responses; once they are freed, glibc keeps
most of the pages for reuse rather than returning them, and a long-lived operator's RSS stays near its
busiest moment's for good (what a memory limit is measured against). `malloc_trim(0)` returns every whole
free page of the heaps. Where the C library has no `malloc_trim` (musl, macOS), nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable
from pathlib import Path

# How often the operator trims, at most: a trim of a heap of some hundred MB takes a few milliseconds.
TRIM_SECONDS = 60.0


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def rss_bytes() -> int:
    """This process's resident set (0 where /proc is not)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Trimmer:
    """`trim()` gives the free pages back and returns how many bytes of RSS that took off (None: cannot)."""

    def __init__(self, trim: Callable[[int], int] | None = None, rss: Callable[[], int] = rss_bytes) -> None:
        self._trim = trim if trim is not None else _malloc_trim()
        self._rss = rss

    @property
    def available(self) -> bool:
        return self._trim is not None

    def trim(self) -> int | None:
        if self._trim is None:
            return None
        before = self._rss()
        self._trim(0)
        return max(0, before - self._rss())
