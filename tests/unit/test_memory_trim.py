"""Memory a burst freed goes back to the system once the work has drained."""

from __future__ import annotations

import asyncio
import logging

import pytest

from sharded_operator.run import handlers, memory
from sharded_operator.run.memory import Trimmer, rss_bytes
from sharded_operator.run.workqueue import WorkQueue


def test_a_trim_reports_what_it_took_off_the_resident_set():
    calls, sizes = [], iter([300, 180])
    trimmer = Trimmer(trim=calls.append, rss=lambda: next(sizes))
    assert trimmer.trim() == 120 and calls == [0]
    grown = Trimmer(trim=lambda pad: 0, rss=iter([100, 150]).__next__)
    assert grown.trim() == 0  # more resident after (other threads allocating): nothing given back, not negative


def test_without_malloc_trim_nothing_is_done(monkeypatch):
    monkeypatch.setattr(memory, "_malloc_trim", lambda: None)  # as where the C library has none (musl, macOS)
    trimmer = Trimmer()
    assert not trimmer.available and trimmer.trim() is None


@pytest.mark.skipif(not Trimmer().available, reason="the C library has no malloc_trim (not glibc)")
def test_the_real_trim_gives_back_the_free_pages_of_a_fragmented_heap():
    # 4 KiB buffers come from malloc's heap (not Python's small-object arenas, not mmap); keeping every 64th
    # pins the heap, so freeing the rest leaves ~60 MiB of free pages that glibc keeps on its own.
    buffers = [bytes(4096) for _ in range(16384)]
    kept = buffers[::64]
    del buffers
    resident = rss_bytes()
    freed = Trimmer().trim()
    assert freed is not None and freed > 20 * 2**20, f"RSS {resident / 2**20:.0f} MiB, trim gave back {freed}"
    assert len(kept) == 256


def test_the_operator_trims_only_while_no_job_waits(monkeypatch, caplog):
    monkeypatch.setattr(handlers, "TRIM_SECONDS", 0.01)
    waiting = []  # jobs waiting at each trim

    async def run():
        queue = WorkQueue()

        class Fake:
            def trim(self):
                waiting.append(len(queue))
                return 5 * 2**20

        task = asyncio.create_task(handlers.trim_memory(queue, Fake(), logging.getLogger("test")))
        queue.add(("ns", "busy"))
        await asyncio.sleep(0.05)
        assert waiting == []  # a job waits: the work is not over
        await queue.get()
        await asyncio.sleep(0.05)
        task.cancel()

    with caplog.at_level(logging.INFO):
        asyncio.run(run())
    assert waiting and set(waiting) == {0}
    assert "gave 5.0 MB of freed memory back" in caplog.text
