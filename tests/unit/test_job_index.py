"""The jobs index keeps each job as JSON (views.JobView) with the few fields read across every job; a
snapshot parses the one job it needs, prefers the object not being deleted, and collects the host ports in
use from the kept fields."""

from __future__ import annotations

import asyncio
import json

import kopf

from sharded_operator.decide.views import JobView, NodeView, PodView
from sharded_operator.run import handlers, watched
from sharded_operator.run.nodewatch import Gone
from sharded_operator.run.reconcile import Context


def job(name: str, uid: str, *, phase: str | None = None, host_port: int | None = None, deleting: bool = False,
        host_network: bool = False) -> dict:  # fmt: skip
    meta = {"name": name, "namespace": "ns", "uid": uid, "managedFields": [{"manager": "kubectl"}] * 50}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status = {k: v for k, v in (("phase", phase), ("hostPort", host_port)) if v is not None}
    return {"apiVersion": "training.sharded.dev/v1alpha1", "kind": "ShardedTrainingJob", "metadata": meta,
            "spec": {"nodes": 2, "network": {"hostNetwork": host_network}}, "status": status}  # fmt: skip


def test_a_job_view_keeps_the_body_without_managed_fields_and_the_fields_read_across_jobs():
    body = job("a", "u1", phase="Running", host_port=29500, deleting=True)
    view = JobView.from_job(body)
    expected = {**body, "metadata": {k: v for k, v in body["metadata"].items() if k != "managedFields"}}
    assert view.body() == expected
    assert (view.phase, view.host_port, view.deleting) == ("Running", 29500, True)
    assert len(view.raw) < len(json.dumps(body)) / 5  # managedFields dropped; nothing else kept besides
    bare = JobView.from_job({"metadata": {"name": "b"}, "spec": {}})  # no status yet
    assert (bare.phase, bare.host_port, bare.deleting) == (None, None, False)


def test_the_index_function_stores_views_and_skips_ignored_namespaces(monkeypatch):
    got = asyncio.run(handlers.jobs(namespace="ns", name="a", body=kopf.Body(job("a", "u1"))))
    assert list(got) == [("ns", "a")] and isinstance(got[("ns", "a")], JobView)
    monkeypatch.setattr(handlers, "SETTINGS", handlers.SETTINGS.model_copy(update={"ignore_namespaces": ["n*"]}))
    assert asyncio.run(handlers.jobs(namespace="ns", name="a", body=kopf.Body(job("a", "u1")))) is None


def test_a_snapshot_takes_the_job_not_being_deleted_and_the_ports_of_unfinished_jobs():
    views = {
        ("ns", "a"): [JobView.from_job(job("a", "old", deleting=True)),
                      JobView.from_job(job("a", "new", host_network=True))],
        ("ns", "b"): [JobView.from_job(job("b", "u2", phase="Running", host_port=30001))],
        ("ns", "c"): [JobView.from_job(job("c", "u3", phase="Succeeded", host_port=30002))],
    }  # fmt: skip
    index = kopf.Memo(jobs=views, job_pods={}, nodes={}, nodes_gone=Gone())
    snap = watched.snapshot(Context(settings=handlers.SETTINGS, kube=None), index, ("ns", "a"))
    assert snap.body["metadata"]["uid"] == "new"
    assert snap.host_ports == frozenset({30001})  # a finished job's port is free again
    assert watched.snapshot(Context(settings=handlers.SETTINGS, kube=None), index, ("ns", "gone")) is None
    assert watched.job_body(views, ("ns", "b"))["status"] == {"phase": "Running", "hostPort": 30001}


def test_a_snapshot_names_the_nodes_its_pods_are_on_that_the_watch_has_neither_listed_nor_deleted():
    index = kopf.Memo(jobs={("ns", "a"): [JobView.from_job(job("a", "u1"))]}, nodes={"up": NodeView()},
                      nodes_gone=Gone(), node_jobs={}, job_pods={("ns", "a"): [
                          PodView(name=f"a-{i}", index=i, attempt=1, phase="Running", node=node, owner_uid="u1")
                          for i, node in enumerate(["up", "deleted", "unreported"])]})  # fmt: skip
    ctx = Context(settings=handlers.SETTINGS, kube=None, nodes_listed=asyncio.Event())
    handlers.nodes_changed(ctx, handlers.WorkQueue(), index, {"deleted": NodeView(), "gone-and-back": None})
    handlers.nodes_changed(ctx, handlers.WorkQueue(), index, {"deleted": None, "gone-and-back": NodeView()})
    assert "deleted" in index.nodes_gone and "gone-and-back" not in index.nodes_gone
    snap = watched.snapshot(Context(settings=handlers.SETTINGS, kube=None), index, ("ns", "a"))
    assert snap.nodes == {"up": NodeView()} and snap.unconfirmed == frozenset({"unreported"})


def test_the_deleted_node_names_kept_are_bounded():
    gone = Gone(kept=3)
    for i in range(5):
        gone.add(f"n{i}")
    assert len(gone) == 3 and "n0" not in gone and "n4" in gone
