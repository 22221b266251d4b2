"""The reconcile work queue and the overlay of the operator's own writes on the watched view."""

from __future__ import annotations

import asyncio

from sharded_operator.decide.views import PodView
from sharded_operator.run.recent import Recent
from sharded_operator.run.workqueue import WorkQueue


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def take(queue: WorkQueue, timeout: float = 0.2):
    try:
        return await asyncio.wait_for(queue.get(), timeout)
    except TimeoutError:
        return None


def test_a_burst_of_events_for_one_job_is_one_look_and_jobs_go_in_arrival_order():
    async def run():
        q = WorkQueue()
        for key in ["a", "b", "a", "a", "c", "b"]:
            q.add(key)
        assert len(q) == 3
        got = [await take(q) for _ in range(3)]
        assert got == ["a", "b", "c"] and await take(q) is None

    asyncio.run(run())


def test_a_job_marked_while_it_is_reconciled_is_looked_at_again_after_never_at_the_same_time():
    async def run():
        q = WorkQueue()
        q.add("a")
        assert await take(q) == "a"
        q.add("a")  # an event during the reconcile
        q.add("a")
        assert await take(q) is None  # a second worker does not get it while the first holds it
        q.done("a")
        assert await take(q) == "a"
        q.done("a")
        assert await take(q) is None

    asyncio.run(run())


def test_timers_fire_at_their_time_and_the_earliest_for_a_job_wins():
    async def run():
        clock = Clock()
        q = WorkQueue(clock)
        q.add_after("a", 30)
        q.add_after("a", 60)  # later: the 30 s one stands
        q.add_after("b", 10)
        q.add_after("b", 5)  # earlier: replaces it
        assert q.scheduled == 2 and await take(q) is None
        clock.t += 5
        assert await take(q) == "b"
        q.done("b")
        clock.t += 20
        assert await take(q) is None
        clock.t += 5
        assert await take(q) == "a" and q.scheduled == 0
        q.done("a")
        q.add_after("c", 1)
        q.forget("c")  # the job was deleted
        clock.t += 2
        assert await take(q) is None

    asyncio.run(run())


def test_a_sleeping_worker_wakes_for_a_new_job_and_for_a_nearer_timer():
    async def run():
        q = WorkQueue()
        waiting = asyncio.create_task(q.get())
        await asyncio.sleep(0.05)
        q.add_after("soon", 0.05)
        assert await asyncio.wait_for(waiting, 2) == "soon"

    asyncio.run(run())


def pod(name: str, uid: str) -> PodView:
    return PodView(name=name, index=0, attempt=1, phase="Pending", uid=uid)


def test_a_created_pod_counts_until_the_watch_shows_it_or_its_deletion():
    clock = Clock()
    recent = Recent(clock, keep=60)
    recent.pod_created("ns/j", pod("j-0", "u0"))
    recent.pod_created("ns/j", pod("j-1", "u1"))
    assert [p.name for p in recent.pods("ns/j", [])] == ["j-0", "j-1"]
    watched = [pod("j-0", "u0")]
    assert [p.uid for p in recent.pods("ns/j", watched)] == ["u0", "u1"]  # j-0 once, as watched
    recent.pod_gone("ns/j", "u1")  # deleted before its creation was ever watched
    assert recent.pods("ns/j", []) == []
    recent.pod_created("ns/j", pod("j-2", "u2"))
    clock.t += 61  # never watched: the overlay does not outlive `keep`
    assert recent.pods("ns/j", []) == []


def test_a_created_pod_counts_through_minutes_of_watch_lag():
    # Pods taken for deleted while their events were late would restart healthy gangs after a burst.
    clock = Clock()
    recent = Recent(clock)
    recent.pod_created("ns/j", pod("j-0", "u0"))
    clock.t += 240
    assert [p.name for p in recent.pods("ns/j", [])] == ["j-0"]
    clock.t += 61
    assert recent.pods("ns/j", []) == []


def owned(status: dict) -> dict:
    return {k: v for k, v in status.items() if k != "progress"}


def test_the_status_written_overrides_an_older_watched_one_and_yields_to_the_watch_once_shown():
    recent = Recent(Clock())
    old = {"phase": "Running", "attempt": 1, "progress": {"step": 9}}
    recent.status_written("uid", {"phase": "Restarting", "attempt": 2})
    # Until the watch shows the write, the fields reconcile owns are as written; progress stays watched.
    assert recent.status("uid", old, owned) == {"phase": "Restarting", "attempt": 2, "progress": {"step": 9}}
    assert recent.status("other-uid", old, owned) == old  # a job of the same name made anew: not ours
    shown = {"phase": "Restarting", "attempt": 2, "progress": {"step": 10}}
    assert recent.status("uid", shown, owned) == shown
    assert recent.status("uid", old, owned) == old  # caught up once: the overlay is gone


def test_a_progress_write_wakes_reconcile_only_when_a_decision_reads_what_it_changed():
    from sharded_operator.run.handlers import _digest

    def job(**progress) -> dict:
        report = {"step": 10, "loss": 2.5, "attempt": 1, "run": "r1", "nodes": 2, "observedAt": "t0", **progress}
        return {"metadata": {"name": "j", "resourceVersion": "1"}, "spec": {"nodes": 2},
                "status": {"phase": "Running", "progress": report}}  # fmt: skip

    base = _digest(job())
    assert _digest(job(step=11, loss=2.4, observedAt="t1")) == base  # a step: the hang timer reads it
    assert _digest(job(run="r2")) != base  # a new trainer process: an in-place recovery may be over
    assert _digest(job(nodes=3)) != base  # an elastic round of another size: status.currentNodes
