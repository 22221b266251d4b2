"""Decide, record, act: a reconcile that deletes pods writes the decision (why they go) first, so an
operator that dies between the two leaves a status that explains the missing pods; and a decision lands
only on the version of the job it was taken from."""

from __future__ import annotations

import logging

import pytest

from sharded_operator.decide.views import NodeView, PodView
from sharded_operator.run.apicalls import Stale, Written
from sharded_operator.run.reconcile import Context, Snapshot, reconcile
from sharded_operator.settings import OperatorSettings
from support.jobs import make_job


class Crash(BaseException):
    """The operator process dying: nothing after it runs."""


class DyingKube:
    """Records what a reconcile sends; dies at the first pod deletion."""

    def __init__(self):
        self.sent = []

    def patch_status(self, namespace, name, status, uid, before=None, resource_version=None):
        self.sent.append(("status", status))
        return Written("2")

    def delete_pod(self, namespace, name, grace, uid=None):
        self.sent.append(("delete", name))
        raise Crash


def test_a_restart_for_a_failure_is_written_before_the_failed_gang_is_deleted():
    job = make_job().nodes(2).status(attempt=1, phase="Running", startTime="2026-01-01T00:00:00Z")
    body = job.obj()
    uid = body["metadata"]["uid"]
    pods = [PodView(name="j-0", index=0, attempt=1, phase="Failed", exit_code=1, node="n0", owner_uid=uid, uid="p0"),
            PodView(name="j-1", index=1, attempt=1, phase="Running", node="n1", owner_uid=uid, uid="p1")]  # fmt: skip
    kube = DyingKube()
    ctx = Context(settings=OperatorSettings(), kube=kube)
    snap = Snapshot(body=body, pods=pods, nodes={"n0": NodeView(), "n1": NodeView()})
    with pytest.raises(Crash):
        reconcile(ctx, snap, logging.getLogger("test"))
    (kind, status), (then, _) = kube.sent[:2]
    assert (kind, then) == ("status", "delete")
    assert status["restarts"] == 1 and status["lastFailure"]["pod"] == "j-0" and status["lastFailure"]["exitCode"] == 1


class FencedKube:
    """The API server's optimistic concurrency over one job: a write over an older version is refused."""

    def __init__(self, job):
        self.job, self.written, self.deleted = job, [], []

    def patch_status(self, namespace, name, status, uid, before=None, resource_version=None):
        current = self.job["metadata"]["resourceVersion"]
        if resource_version != current:
            raise Stale(f"{name} changed since {resource_version}")
        self.job = {**self.job, "status": {**self.job.get("status", {}), **status},
                    "metadata": {**self.job["metadata"], "resourceVersion": str(int(current) + 1)}}  # fmt: skip
        self.written.append((resource_version, status))
        return Written(self.job["metadata"]["resourceVersion"])

    def get_job(self, namespace, name):
        return self.job

    def delete_pod(self, namespace, name, grace, uid=None):
        self.deleted.append(name)

    def event(self, *args):
        pass


def test_a_decision_from_an_older_view_of_the_job_never_lands_and_is_taken_again_from_the_job_as_it_is():
    """A replica that lost the Lease without knowing it yet sees attempt 1 with a failed pod and decides a
    restart; the replica that holds the Lease has already restarted the gang (attempt 2, one restart). The
    stale replica's write is refused and, deciding again from the job as it is now, it counts no second
    restart for the same failure."""
    seen = make_job().nodes(2).status(attempt=1, phase="Running", startTime="2026-01-01T00:00:00Z").obj()
    seen["metadata"]["resourceVersion"] = "7"
    uid = seen["metadata"]["uid"]
    pods = [PodView(name="j-0", index=0, attempt=1, phase="Failed", exit_code=1, node="n0", owner_uid=uid, uid="p0"),
            PodView(name="j-1", index=1, attempt=1, phase="Running", node="n1", owner_uid=uid, uid="p1")]  # fmt: skip
    kube = FencedKube(seen)
    ctx = Context(settings=OperatorSettings(), kube=kube)
    first = reconcile(ctx, Snapshot(body=seen, pods=pods, nodes={"n0": NodeView(), "n1": NodeView()}),
                      logging.getLogger("test"))  # fmt: skip
    assert first.status.attempt == 2 and first.status.restarts == 1
    assert [v for v, _ in kube.written][:1] == ["7"]
    # Now the stale replica, still holding the view of version 7.
    stale_ctx = Context(settings=OperatorSettings(), kube=kube)
    writes_before = len(kube.written)
    again = reconcile(stale_ctx, Snapshot(body=seen, pods=pods, nodes={"n0": NodeView(), "n1": NodeView()}),
                      logging.getLogger("test"))  # fmt: skip
    assert again.status.attempt == 2 and again.status.restarts == 1, "the same failure was counted twice"
    assert all(v != "7" for v, _ in kube.written[writes_before:]), "a decision from version 7 landed twice"
    assert kube.job["status"]["restarts"] == 1 and stale_ctx.metrics.stale_writes._value.get() == 1


def test_a_job_that_keeps_changing_under_every_decision_is_left_to_the_workers_backoff():
    body = make_job().nodes(2).status(attempt=1, phase="Running", startTime="2026-01-01T00:00:00Z").obj()
    body["metadata"]["resourceVersion"] = "1"
    uid = body["metadata"]["uid"]
    pods = [PodView(name="j-0", index=0, attempt=1, phase="Failed", exit_code=1, node="n0", owner_uid=uid, uid="p0")]

    class Busy(FencedKube):
        """A progress report lands between every read and every write."""

        def get_job(self, namespace, name):
            meta = self.job["metadata"]
            self.job = {**self.job, "metadata": {**meta, "resourceVersion": str(int(meta["resourceVersion"]) + 1)}}
            return {**self.job, "metadata": {**meta}}

    kube = Busy({**body, "metadata": {**body["metadata"], "resourceVersion": "2"}})
    with pytest.raises(Stale, match="decisions in a row"):
        reconcile(Context(settings=OperatorSettings(), kube=kube),
                  Snapshot(body=body, pods=pods, nodes={"n0": NodeView()}), logging.getLogger("test"))  # fmt: skip
    assert kube.written == [] and kube.deleted == []
