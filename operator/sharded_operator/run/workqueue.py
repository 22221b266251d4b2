"""The jobs to reconcile: each queued at most once, never reconciled by two workers at once, fair.

Events only mark a job to look at; a fixed number of workers take jobs in arrival order. A job's burst of
events (eight pods starting) becomes one or two reconciles, not eight reconciles waiting on a lock while
every other job waits for a free thread. `add_after` schedules the next look at a job whose decision
depends on time (a deadline, a hang timeout, a lost node's grace), so nothing polls jobs at rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import time
from collections import deque
from collections.abc import Callable, Hashable


class WorkQueue:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._ready: deque[Hashable] = deque()
        self._queued: set[Hashable] = set()  # in _ready
        self._active: set[Hashable] = set()  # taken by a worker, not done yet
        self._dirty: set[Hashable] = set()  # added while active: queued again once done
        self._timers: dict[Hashable, float] = {}  # key -> when (the earliest asked for)
        self._heap: list[tuple[float, int, Hashable]] = []
        self._seq = 0
        self._wake = asyncio.Event()

    def __len__(self) -> int:
        return len(self._ready)

    @property
    def scheduled(self) -> int:
        return len(self._timers)

    def add(self, key: Hashable) -> None:
        if key in self._active:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._ready.append(key)
            self._wake.set()

    def add_after(self, key: Hashable, delay: float) -> None:
        """Queue `key` in `delay` seconds; an earlier timer for it stands, a later one is replaced."""
        when = self.clock() + max(0.0, delay)
        if self._timers.get(key, float("inf")) <= when:
            return
        self._timers[key] = when
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, key))
        self._wake.set()

    def forget(self, key: Hashable) -> None:
        """Drop the key's timer (the job is gone); a queued or running look at it still happens."""
        self._timers.pop(key, None)

    def _fire_timers(self) -> float | None:
        """Queue the keys whose time has come; seconds until the next timer, if any."""
        now = self.clock()
        while self._heap:
            when, _, key = self._heap[0]
            if self._timers.get(key) != when:  # replaced by an earlier one, or forgotten
                heapq.heappop(self._heap)
                continue
            if when > now:
                return when - now
            heapq.heappop(self._heap)
            del self._timers[key]
            self.add(key)
        return None

    async def get(self) -> Hashable:
        while True:
            wait = self._fire_timers()
            if self._ready:
                key = self._ready.popleft()
                self._queued.discard(key)
                self._active.add(key)
                return key
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=wait)

    def done(self, key: Hashable) -> None:
        self._active.discard(key)
        if key in self._dirty:
            self._dirty.discard(key)
            self.add(key)
