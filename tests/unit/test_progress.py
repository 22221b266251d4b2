"""Who may report progress and what a report changes, as tables; the bounded caches and rate limits behind
them; liveness; and the Lease arithmetic of leader election. The same checks against the real API server
(TokenReview, bound tokens, two replicas) are in tests/integration/test_progress_security.py."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import threading

import pytest

from sharded_api.contract import ProgressReport, TrainerEventType, iso
from sharded_operator.api.models import LABEL_ATTEMPT, LABEL_JOB
from sharded_operator.api.status import ShardedTrainingJobStatus
from sharded_operator.decide.progress import (
    POD_NAME_EXTRA,
    POD_UID_EXTRA,
    Refusal,
    Sender,
    bearer,
    check_sender,
    merge_report,
    precheck,
    sender_from_review,
)
from sharded_operator.run.election import LEASE_SECONDS, RENEW_DEADLINE, Leadership, Observed, claim, micro_time
from sharded_operator.run.intake import MAX_PENDING, Bucket, JobDesk, ProgressDesk, TTLCache
from sharded_operator.run.web import Health, Metrics
from sharded_operator.settings import OperatorSettings
from support.jobs import make_job

NOW = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)
CKPT_8, CKPT_9 = ({"step": n, "path": f"/checkpoints/step-{n:08d}", "time": "2026-01-01T00:00:00Z"} for n in (8, 9))
AUD = "training.sharded.dev/progress"


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def report(**fields) -> ProgressReport:
    """A report of rank 0 of job `j`'s attempt 1, as the trainer posts it."""
    base = {"uid": "uid-j", "namespace": "default", "name": "j", "attempt": 1, "run": "r1", "step": 1}
    return ProgressReport.model_validate({**base, "updatedAt": iso(NOW), **fields})


def event(seq: int, type_: TrainerEventType = TrainerEventType.CHECKPOINT_COMMITTED, **fields) -> dict:
    return {"seq": seq, "type": type_.value, "message": f"event {seq}", "time": iso(NOW), **fields}


def status(**fields):
    return make_job().status(**{"attempt": 1, "phase": "Running", **fields}).model().status


def jwt(claims: dict) -> str:
    def part(d):
        return base64.urlsafe_b64encode(json.dumps(d).encode()).decode().rstrip("=")

    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2lnbmF0dXJl"


BOUND = {"aud": [AUD], "exp": 2_000_000_000, "kubernetes.io": {"namespace": "default", "pod": {"name": "j-0"}}}


# --- who may report -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [None, "", "Basic abc", "Bearer ", "Bearer " + "x" * 9000],
    ids=["none", "empty", "basic", "blank", "huge"],
)
def test_a_report_without_a_bearer_token_is_unauthorized(header):
    with pytest.raises(Refusal) as r:
        bearer(header)
    assert r.value.status == 401


@pytest.mark.parametrize(
    "token,why",
    [
        ("junk", "not a ServiceAccount token"),
        ("a.!!!.b", "not a ServiceAccount token"),
        (jwt([1, 2]), "not a ServiceAccount token"),
        (jwt({**BOUND, "aud": ["https://kubernetes.default.svc"]}), "audience"),
        (jwt({**BOUND, "exp": 1_000}), "expired"),
        (jwt({k: v for k, v in BOUND.items() if k != "kubernetes.io"}), "not bound to a pod"),
    ],
    ids=["junk", "bad-base64", "not-an-object", "api-audience", "expired", "unbound"],
)
def test_junk_is_refused_before_any_api_call(token, why):
    with pytest.raises(Refusal) as r:
        precheck(token, AUD, now=1_800_000_000)
    assert r.value.status == 401 and why in r.value.reason
    precheck(jwt(BOUND), AUD, now=1_800_000_000)  # the shape of a real one passes on to the TokenReview


def review(**user) -> dict:
    extra = {POD_NAME_EXTRA: ["j-0"], POD_UID_EXTRA: ["pod-uid"]}
    return {"authenticated": True, "audiences": [AUD],
            "user": {"username": "system:serviceaccount:default:default", "extra": extra, **user}}  # fmt: skip


def test_the_token_review_names_the_pod_that_sends():
    assert sender_from_review(review(), AUD) == Sender("default", "default", "j-0", "pod-uid")
    for bad in (
        {"authenticated": False, "error": "token has been invalidated"},
        {**review(), "audiences": ["other"]},
        review(username="alice"),
        review(extra={}),
    ):
        with pytest.raises(Refusal) as r:
            sender_from_review(bad, AUD)
        assert r.value.status == 401


def pod(attempt: int = 1, job: str = "j", owner: str = "uid-j", uid: str = "pod-uid", deleting: bool = False) -> dict:
    meta = {"name": "j-0", "uid": uid, "labels": {LABEL_JOB: job, LABEL_ATTEMPT: str(attempt)},
            "ownerReferences": [{"uid": owner, "controller": True}]}  # fmt: skip
    if deleting:
        meta["deletionTimestamp"] = iso(NOW)
    return {"metadata": meta}


@pytest.mark.parametrize(
    "sender,the_pod,why",
    [
        (Sender("other", "default", "j-0", "pod-uid"), pod(), "namespace"),
        (Sender("default", "default", "j-0", "pod-uid"), None, "gone"),
        (Sender("default", "default", "j-0", "pod-uid"), pod(deleting=True), "gone"),
        (Sender("default", "default", "j-0", "pod-uid"), pod(uid="another-pod"), "gone"),
        (Sender("default", "default", "j-0", "pod-uid"), pod(job="k"), "does not belong"),
        (Sender("default", "default", "j-0", "pod-uid"), pod(owner="uid-of-an-older-j"), "does not belong"),
        (Sender("default", "default", "j-0", "pod-uid"), pod(attempt=2), "attempt 2"),
    ],
    ids=["other-namespace", "pod-gone", "pod-deleting", "pod-replaced", "other-job", "older-job", "other-attempt"],
)
def test_only_a_live_pod_of_the_reported_job_and_attempt_may_report(sender, the_pod, why):
    with pytest.raises(Refusal) as r:
        check_sender(report(), sender, the_pod)
    assert r.value.status == 403 and why in r.value.reason
    check_sender(report(), Sender("default", "default", "j-0", "pod-uid"), pod())


# --- what a report changes ----------------------------------------------------------------------------


def test_a_report_fills_progress_and_last_checkpoint():
    ckpt = {"step": 30, "path": "/checkpoints/step-00000030", "time": iso(NOW)}
    sent = report(step=40, totalSteps=100, loss=2.5, mfu=0.3, mfu6n=0.45, lastCheckpoint=ckpt)
    fields, _ = merge_report(status(), sent, iso(NOW))
    assert fields["progress"]["step"] == 40 and fields["progress"]["loss"] == 2.5
    assert (fields["progress"]["mfu"], fields["progress"]["mfu6n"]) == (0.3, 0.45)  # both MFUs, each labelled
    assert fields["progress"]["observedAt"] == iso(NOW) and fields["lastCheckpoint"] == ckpt
    # A preference-training run's rewards reach status.progress as reported.
    fields, _ = merge_report(status(), report(step=41, version=3, rewardAccuracy=0.9, rewardMargin=0.6), iso(NOW))
    assert (fields["progress"]["rewardAccuracy"], fields["progress"]["rewardMargin"]) == (0.9, 0.6)
    with pytest.raises(Refusal) as r:
        merge_report(status(attempt=2), report(step=41), iso(NOW))
    assert r.value.status == 403 and "attempt 2" in r.value.reason


def test_trainer_events_become_kubernetes_events_once():
    rep = report(events=[event(1), event(2, TrainerEventType.CHECKPOINT_SET_ASIDE)])
    fields, events = merge_report(status(), rep, iso(NOW))
    assert events == [("Normal", "CheckpointCommitted", "event 1"), ("Warning", "CheckpointSetAside", "event 2")]
    assert fields["lastTrainerEvent"] == {"attempt": 1, "run": "r1", "seq": 2}
    # The same report again (the trainer re-sends events until acknowledged), then one more: only that one.
    written = status(lastTrainerEvent=fields["lastTrainerEvent"])
    assert merge_report(written, rep, iso(NOW))[1] == []
    more = report(events=[event(1), event(2), event(3, TrainerEventType.RESUMED)])
    assert [e[1] for e in merge_report(written, more, iso(NOW))[1]] == ["ResumedFromCheckpoint"]
    # A restarted trainer process numbers its events from 1 again.
    restarted = report(run="r2", events=[event(1, TrainerEventType.RESUMED)])
    assert [e[1] for e in merge_report(written, restarted, iso(NOW))[1]] == ["ResumedFromCheckpoint"]


def test_the_checkpoint_resumed_from_shows_in_status():
    checkpoint = {"step": 20, "path": "/checkpoints/j/step-00000020"}
    resumed = event(1, TrainerEventType.RESUMED, step=20, checkpoint=checkpoint)
    fields, _ = merge_report(status(), report(events=[resumed]), iso(NOW))
    assert fields["resumedFrom"] == checkpoint


def test_the_same_report_seen_again_keeps_its_first_sighting():
    first, _ = merge_report(status(), report(step=6), iso(NOW))
    later = iso(NOW + dt.timedelta(seconds=30))
    again, _ = merge_report(status(progress=first["progress"]), report(step=6), later)
    assert again["progress"]["observedAt"] == iso(NOW)  # no new report: the hang timer runs on
    newer, _ = merge_report(status(progress=first["progress"]), report(step=7), later)
    assert newer["progress"]["observedAt"] == later


def test_in_place_restarts_are_counted_once_each_over_every_attempt():
    """A new trainer process reporting for the same attempt is one in-place restart (torchrun restarts every
    node's workers; its own count grows only on the node that failed, here node 1, so rank 0 says 0); a
    repeat counts nothing, nor a late report of the earlier process, nor the first run of a new attempt."""
    later = [iso(NOW + dt.timedelta(seconds=s)) for s in range(0, 100, 10)]
    first, _ = merge_report(status(inPlaceRestarts=2), report(step=5, updatedAt=later[0]), iso(NOW))
    assert "inPlaceRestarts" not in first and first["progress"]["run"] == "r1"
    restarted, _ = merge_report(status(inPlaceRestarts=2, progress=first["progress"]),
                                report(run="r2", step=3, restart=0, updatedAt=later[1]), iso(NOW))  # fmt: skip
    assert restarted["inPlaceRestarts"] == 3 and restarted["progress"]["run"] == "r2"
    again, _ = merge_report(status(inPlaceRestarts=3, progress=restarted["progress"]),
                            report(run="r2", step=4, updatedAt=later[2]), iso(NOW))  # fmt: skip
    assert "inPlaceRestarts" not in again  # the same process again
    late, _ = merge_report(status(inPlaceRestarts=3, progress=again["progress"]),
                           report(run="r1", step=6, updatedAt=later[0]), iso(NOW))  # fmt: skip
    assert "inPlaceRestarts" not in late  # the dead process's last report, arriving late
    twice, _ = merge_report(status(inPlaceRestarts=3, progress=again["progress"]),
                            report(run="r3", step=4, updatedAt=later[3]), iso(NOW))  # fmt: skip
    assert twice["inPlaceRestarts"] == 4
    next_attempt = status(attempt=2, inPlaceRestarts=4, progress=twice["progress"])
    fresh, _ = merge_report(next_attempt, report(attempt=2, run="r4", step=1, updatedAt=later[4]), iso(NOW))
    assert "inPlaceRestarts" not in fresh  # a new attempt's first process is a gang restart, counted apart


def test_a_report_older_than_what_status_holds_changes_nothing():
    """Two replicas take reports side by side: the one holding an older report (an earlier step, or the last
    report of a process that has since been restarted in place) must not move status backwards, nor count
    the restart a second time when the newer process reports again."""
    t = [iso(NOW + dt.timedelta(seconds=s)) for s in range(0, 100, 10)]
    newer, _ = merge_report(status(), report(step=9, updatedAt=t[2], lastCheckpoint=CKPT_9), iso(NOW))
    held = status(progress=newer["progress"], lastCheckpoint=newer["lastCheckpoint"])
    assert merge_report(held, report(step=8, updatedAt=t[1], lastCheckpoint=CKPT_8), iso(NOW)) == ({}, [])
    assert merge_report(held, report(step=9, updatedAt=t[1]), iso(NOW)) == ({}, [])
    assert merge_report(held, report(step=10, updatedAt=t[3]), iso(NOW))[0]["progress"]["step"] == 10
    restarted, _ = merge_report(held, report(run="r2", step=3, updatedAt=t[4]), iso(NOW))
    after = status(inPlaceRestarts=restarted["inPlaceRestarts"], progress=restarted["progress"])
    late = report(run="r1", step=9, updatedAt=t[3], events=[event(1)])
    assert merge_report(after, late, iso(NOW)) == ({}, [])  # no step back, no event of the dead process again
    again, _ = merge_report(after, report(run="r2", step=4, updatedAt=t[5]), iso(NOW))
    assert "inPlaceRestarts" not in again


class SlowKube:
    """The API as the progress desk uses it, with a report's write held until `gate` opens."""

    def __init__(self):
        self.job = {"metadata": {"uid": "uid-j", "namespace": "default", "name": "j", "resourceVersion": "1"},
                    "status": {"attempt": 1, "phase": "Running"}}  # fmt: skip
        self.gate, self.entered, self.written = threading.Event(), threading.Event(), []

    def issuer_discovery(self):
        return None

    issuer_keys = issuer_discovery

    def get_job(self, namespace, name):
        return self.job

    def patch_report(self, namespace, name, fields, rv):
        self.entered.set()
        assert self.gate.wait(10)
        self.written.append(fields["progress"]["step"])
        meta = {**self.job["metadata"], "resourceVersion": str(int(rv) + 1)}
        self.job = {"metadata": meta, "status": {**self.job["status"], **fields}}
        return True

    def event(self, *args):
        pass


def test_a_report_taken_while_another_is_being_written_is_written_after_it_never_dropped():
    """The final report arrives while the previous one's write is in flight: it is the one that must land."""
    kube = SlowKube()
    desk = ProgressDesk(kube, OperatorSettings(progress_write_seconds=10), Metrics())

    async def scenario():
        first = asyncio.create_task(desk._accept(report(step=5, totalSteps=6)))
        assert await asyncio.to_thread(kube.entered.wait, 5)  # its write is in flight
        last = asyncio.create_task(desk._accept(report(step=6, totalSteps=6)))
        await asyncio.sleep(0.1)  # taken, waiting for the write before it
        kube.gate.set()
        return await asyncio.gather(first, last)

    answers = asyncio.run(scenario())
    assert kube.written == [5, 6] and [a["written"] for a in answers] == [True, True]
    assert kube.job["status"]["progress"]["step"] == 6 and desk.jobs["uid-j"].report is None


def test_progress_work_runs_on_its_own_threads_and_is_shed_past_its_bound():
    """A slow API server queues a bounded amount of progress work, on threads nothing else needs (the Lease
    renews on its own); past the bound a report is refused with 503, and the trainer sends the next one."""
    desk = ProgressDesk(SlowKube(), OperatorSettings(), Metrics())
    assert asyncio.run(desk._run(lambda: threading.current_thread().name)).startswith("progress")
    desk.pending = MAX_PENDING
    with pytest.raises(Refusal) as refused:
        asyncio.run(desk._run(lambda: None))
    assert refused.value.status == 503


def test_a_flush_whose_writes_fail_says_so_until_one_lands_and_hearing_stops_meanwhile():
    """Reports taken but not written (the API server away) leave status behind what the pods said: the desk
    says so, and the operator's hearing (what the hang timers count) stops until writes land again."""
    from sharded_operator.run.election import Hearing

    kube = SlowKube()
    kube.gate.set()
    desk = ProgressDesk(kube, OperatorSettings(progress_write_seconds=0), Metrics())
    desk.jobs["uid-j"] = JobDesk(report=report(step=5))
    down = kube.patch_report
    kube.patch_report = lambda *a: (_ for _ in ()).throw(ConnectionError("the API server is away"))
    asyncio.run(desk.flush())
    assert desk.failing and desk.jobs["uid-j"].report is not None  # kept for the next flush
    hearing = Hearing()
    hearing.hearing(NOW)
    hearing.deaf()
    assert hearing.since is None
    kube.patch_report = down
    asyncio.run(desk.flush())
    assert not desk.failing and kube.written == [5]
    hearing.hearing(NOW + dt.timedelta(seconds=30))
    assert hearing.since == NOW + dt.timedelta(seconds=30)  # the timers start again from here
    asyncio.run(desk.flush())  # nothing left to write: nothing failing
    assert not desk.failing


# --- bounded state -------------------------------------------------------------------------------


def test_the_cache_forgets_expired_entries_and_holds_at_most_its_size():
    clock = Clock()
    cache = TTLCache(size=3, ttl=10, clock=clock)
    for i in range(5):
        cache.put(str(i), i)
    assert len(cache) == 3 and cache.get("0") is None and cache.get("4") == 4
    clock.t += 11
    assert cache.get("4") is None


def test_the_bucket_allows_a_burst_then_the_rate():
    clock = Clock()
    bucket = Bucket(rate=2, burst=4, clock=clock)
    assert [bucket.take() for _ in range(5)] == [True] * 4 + [False]
    clock.t += 1
    assert [bucket.take() for _ in range(3)] == [True, True, False]


def test_health_fails_once_a_loop_stops_beating():
    clock = Clock()
    health = Health(limit=30, clock=clock)
    health.beat("resync")
    health.beat("election")
    clock.t += 20
    health.beat("election")
    assert health.stale() == []
    clock.t += 15
    assert health.stale() == ["resync"]


# --- leader election ----------------------------------------------------------------------------


def test_a_lease_is_taken_when_free_or_unchanged_for_its_duration_as_the_standby_saw_it():
    a, b = Observed(), Observed()
    held = claim(None, "a", NOW, a, 0.0)
    assert held["holderIdentity"] == "a" and held["leaseTransitions"] == 1
    assert claim(held, "b", NOW, b, 500.0) is None  # first seen now: valid for its duration from now
    assert claim(held, "b", NOW, b, 500.0 + LEASE_SECONDS - 0.1) is None
    later = NOW + dt.timedelta(seconds=5)
    renewed = claim(held, "a", later, a, 5.0)
    assert renewed["acquireTime"] == held["acquireTime"] and renewed["renewTime"] == micro_time(later)
    taken = claim(held, "b", NOW, b, 500.0 + LEASE_SECONDS)
    assert taken["holderIdentity"] == "b" and taken["leaseTransitions"] == 2


def test_a_skewed_clock_never_lets_the_standby_take_a_lease_that_is_being_renewed():
    """The holder's clock 10 s behind the standby's: its renewTime always looks 10 s old, more than the
    deadline. The standby goes by the record changing under its own eyes, and waits."""
    a, b = Observed(), Observed()
    record = None
    for i in range(20):  # renewed every 2 s; the standby looks in between
        record = claim(record, "a", NOW + dt.timedelta(seconds=2 * i), a, 2.0 * i)
        assert claim(record, "b", NOW + dt.timedelta(seconds=2 * i + 11), b, 2.0 * i + 1) is None
    last = 2.0 * 19 + 1
    assert claim(record, "b", NOW, b, last + LEASE_SECONDS - 1.1) is None
    assert claim(record, "b", NOW, b, last + LEASE_SECONDS)["holderIdentity"] == "b"


def test_a_holder_that_cannot_renew_stops_acting_before_another_may_take_over():
    me = Leadership("a")
    assert not me.leading(NOW)
    me.record(True, NOW, NOW)
    assert me.leading(NOW + dt.timedelta(seconds=RENEW_DEADLINE - 1))
    # a failed renewal, still in time
    me.record(False, NOW + dt.timedelta(seconds=RENEW_DEADLINE - 2), NOW + dt.timedelta(seconds=RENEW_DEADLINE - 1))
    assert me.leading(NOW + dt.timedelta(seconds=RENEW_DEADLINE - 1))
    assert not me.leading(NOW + dt.timedelta(seconds=RENEW_DEADLINE))
    assert RENEW_DEADLINE < LEASE_SECONDS  # stops before the lease can pass to another replica
    assert Leadership("a", enabled=False).leading(NOW)  # a single replica always acts


def test_the_holders_deadline_runs_from_before_its_request_not_from_a_slow_answer():
    """A renewal sent at NOW that the API server answered 6 s later: the standby may have seen the record
    change at any moment after NOW, so the holder acts only until NOW + RENEW_DEADLINE."""
    me = Leadership("a")
    me.record(True, NOW, NOW + dt.timedelta(seconds=6))
    assert me.leading(NOW + dt.timedelta(seconds=RENEW_DEADLINE - 0.1))
    assert not me.leading(NOW + dt.timedelta(seconds=RENEW_DEADLINE))


def test_a_change_of_only_the_reported_fields_does_not_cause_a_reconcile():
    from sharded_operator.run.handlers import _digest

    job = make_job().status(attempt=1, phase="Running").obj()
    job["metadata"]["resourceVersion"] = "1"
    reported = {**job, "metadata": {**job["metadata"], "resourceVersion": "2"},
                "status": {**job["status"], "progress": {"step": 5}, "lastTrainerEvent": {"attempt": 1, "run": "r",
                                                                                           "seq": 2}}}  # fmt: skip
    assert _digest(reported) == _digest(job)
    assert _digest({**job, "status": {**job["status"], "phase": "Restarting"}}) != _digest(job)
    assert _digest({**job, "spec": {**job["spec"], "nodes": 3}}) != _digest(job)


@pytest.mark.parametrize(
    "field,value",
    [("nodes", 0), ("nodes", 1025), ("nodes", 2.5), ("globalBatchSize", 0), ("globalBatchSize", 10**9),
     ("restart", -1), ("restart", 1001)],
)  # fmt: skip
def test_a_report_with_an_out_of_range_size_or_restart_count_is_refused_by_the_contract(field, value):
    with pytest.raises(ValueError, match=field):
        report(**{field: value})


def test_the_rounds_size_and_global_batch_reach_the_status():
    merged, _ = merge_report(ShardedTrainingJobStatus(attempt=1), report(nodes=2, globalBatchSize=48), iso(NOW))
    assert merged["progress"]["nodes"] == 2 and merged["progress"]["globalBatchSize"] == 48


def test_the_export_and_the_held_out_loss_show_in_status():
    export = {"step": 60, "path": "/checkpoints/j/export"}
    written = event(1, TrainerEventType.EXPORT_WRITTEN, step=60, checkpoint=export)
    fields, events = merge_report(status(), report(step=60, evalLoss=0.25, events=[written]), iso(NOW))
    assert fields["export"] == export and fields["progress"]["evalLoss"] == 0.25
    assert events == [("Normal", "ExportWritten", "event 1")]
    # Only reports write it: a reconcile's status patch never names it.
    from sharded_operator.decide.progress import REPORT_FIELDS

    assert "export" in REPORT_FIELDS
