"""The operator's node watch against the real API server: the first listing, a node added, a node going
NotReady, and a node deleted while the watch was away, passed on when it resumes from the version it had
seen. (A version the API server no longer keeps, 410 Gone, needs an API server's history to have moved
past it: tests/unit/test_nodewatch.py scripts it.)"""

from __future__ import annotations

import dataclasses
import datetime as dt
import queue

import pytest

from conftest import wait_for
from sharded_api.contract import iso
from sharded_operator.decide.views import NodeView
from sharded_operator.run.k8s import Kube
from sharded_operator.run.nodewatch import NodeWatch

pytestmark = pytest.mark.integration


@pytest.fixture
def watched(cluster, monkeypatch):
    monkeypatch.setattr("sharded_operator.run.nodewatch.WATCH_SECONDS", 2)  # so the test can stop it between watches
    listed: queue.Queue = queue.Queue()
    changed: queue.Queue = queue.Queue()
    watch = NodeWatch(Kube.connect(str(cluster.kubeconfig)), listed.put, lambda n, v: changed.put((n, v)))
    watch.start()
    yield watch, listed, changed
    watch.stop.set()
    watch.thread.join(timeout=30)


def next_change(changed: queue.Queue, name: str, timeout: float = 30) -> NodeView | None:
    """The next change the watch passed on for node `name` (changes of other nodes are skipped)."""
    deadline = dt.datetime.now() + dt.timedelta(seconds=timeout)
    while (left := (deadline - dt.datetime.now()).total_seconds()) > 0:
        node, view = changed.get(timeout=left)
        if node == name:
            return view
    raise AssertionError(f"no change of {name} in {timeout}s")


def set_ready(core, name: str, status: str, since: str) -> None:
    core.patch_node_status(name, {"status": {"conditions": [{
        "type": "Ready", "status": status, "reason": "Test", "message": "set by the test",
        "lastHeartbeatTime": since, "lastTransitionTime": since,
    }]}})  # fmt: skip


def test_the_node_watch_follows_readiness_and_a_deletion_while_it_was_away(cluster, core, watched):
    watch, listed, changed = watched
    first = listed.get(timeout=30)
    names = {n.metadata.name for n in core.list_node().items}
    assert set(first) == names and all(v is not None for v in first.values())

    name = "nodewatch-extra"
    cluster.add_gpu_node(name)
    try:
        wait_for(lambda: watch.views.get(name) == NodeView(ready=True), timeout=30, what="the new node Ready")
        # Down (a node monitor would say Unknown): passed on with when it went down.
        since = iso(dt.datetime.now(dt.UTC) - dt.timedelta(seconds=30))
        down = {"metadata": {"annotations": {"kwok.sharded.dev/down": "true"}}}
        core.patch_node(name, down)
        set_ready(core, name, "Unknown", since)
        view = next_change(changed, name)
        while view is not None and view.since is None:  # KWOK's own writes of the down node may land first
            view = next_change(changed, name)
        assert view == NodeView(ready=False, since=since)

        # The watch away (its connection lost, say) while the node is deleted: back, it resumes from the last
        # version it saw, without listing again, and the deletion is passed on.
        watch.stop.set()
        watch.thread.join(timeout=30)
        assert not watch.thread.is_alive()
        core.delete_node(name)
        watch.stop.clear()
        watch.start()
        assert next_change(changed, name) is None
        assert name not in watch.views and set(watch.views) == names and listed.empty()
    finally:
        if name in {n.metadata.name for n in core.list_node().items}:
            core.delete_node(name)


def test_a_node_the_watch_has_not_reported_is_asked_for_before_it_is_declared_lost(cluster, core):
    """Pods on a node the index lacks (the watch in backoff, say): the API server is asked. A node that exists
    is judged on what it says, one that does not (404) is lost, and one that cannot be looked up is not judged
    at all yet: absence from the index is never taken for a deletion."""
    import logging

    from sharded_operator.decide.lifecycle import decide
    from sharded_operator.decide.views import Observed, PodView
    from sharded_operator.run.reconcile import Context, Snapshot, confirmed
    from sharded_operator.settings import OperatorSettings
    from support.jobs import make_job

    name = "nodewatch-unreported"
    cluster.add_gpu_node(name)
    try:
        wait_for(lambda: any(c.type == "Ready" and c.status == "True"
                             for c in core.read_node_status(name).status.conditions or []),
                 timeout=30, what="the node Ready")  # fmt: skip
        job = make_job().nodes(2).status(attempt=1, phase="Running", startTime=iso(dt.datetime.now(dt.UTC)))
        pods = [PodView(name="j-0", index=0, attempt=1, phase="Running", node=name),
                PodView(name="j-1", index=1, attempt=1, phase="Running", node="nodewatch-never-was")]  # fmt: skip
        snap = Snapshot(body=job.obj(), pods=pods, nodes={}, unconfirmed=frozenset({name, "nodewatch-never-was"}))
        log = logging.getLogger("test")
        now = dt.datetime.now(dt.UTC)

        nodes = confirmed(Context(settings=OperatorSettings(), kube=Kube.connect(str(cluster.kubeconfig))), snap, log)
        assert nodes == {name: NodeView(ready=True)}
        plan = decide(job.model(), Observed(pods=pods, nodes=nodes), now, {"restart": 3, "suspend": 5})
        assert plan.status.last_failure.reason == "NodeLost" and plan.status.last_failure.pod == "j-1"
        assert "nodewatch-never-was no longer exists" in plan.status.last_failure.message

        # The API server unreachable: neither node is judged.
        dead = Kube.connect(str(cluster.kubeconfig))
        dead.http.credentials = dataclasses.replace(dead.http.credentials, server="https://127.0.0.1:1")
        nodes = confirmed(Context(settings=OperatorSettings(), kube=dead), snap, log)
        assert nodes == {name: NodeView(ready=False), "nodewatch-never-was": NodeView(ready=False)}
        plan = decide(job.model(), Observed(pods=pods, nodes=nodes), now, {"restart": 3, "suspend": 5})
        assert plan.status.last_failure is None and plan.status.phase == "Running"
    finally:
        core.delete_node(name)
