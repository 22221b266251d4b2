"""Decide, record, act: a reconcile that deletes pods writes the decision (why they go) first, so an
operator that dies between the two leaves a status that explains the missing pods."""

from __future__ import annotations

import logging

import pytest

from jobs import make_job
from sharded_operator.reconcile import Context, Snapshot, reconcile
from sharded_operator.settings import OperatorSettings
from sharded_operator.views import NodeView, PodView


class Crash(BaseException):
    """The operator process dying: nothing after it runs."""


class DyingKube:
    """Records what a reconcile sends; dies at the first pod deletion."""

    def __init__(self):
        self.sent = []

    def patch_status(self, namespace, name, status, uid, before=None):
        self.sent.append(("status", status))
        return True

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
