"""The operator's node watch: only readiness changes pass, a dropped watch resumes from the last version seen,
an expired one lists again and reports what changed while it was away (a node deleted meanwhile included)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from sharded_operator.decide.views import NodeView
from sharded_operator.run.apicalls import Expired, Malformed
from sharded_operator.run.k8s import Kube
from sharded_operator.run.nodewatch import STUCK_AFTER, NodeWatch, changes


def node(name: str, rv: str, ready: bool | None = True, beat: str = "t0",
         since: str = "2026-01-01T00:00:00Z") -> dict:  # fmt: skip
    status = {True: "True", False: "False", None: "Unknown"}[ready]
    cond = {"type": "Ready", "status": status, "lastTransitionTime": since, "lastHeartbeatTime": beat}
    return {"metadata": {"name": name, "resourceVersion": rv}, "status": {"conditions": [cond]}}


class ScriptedKube:
    """list_nodes answers from `lists`, watch_nodes from `watches`: each a list of events, or an exception to
    raise after them. Records the versions each watch started from."""

    def __init__(self, lists, watches, watch: NodeWatch | None = None):
        self.lists, self.watches, self.started_from = list(lists), list(watches), []
        self.watch = watch

    def list_nodes(self):
        return self.lists.pop(0)

    def watch_nodes(self, version, timeout):
        self.started_from.append(version)
        if not self.watches:
            self.watch.stop.set()
            return
        script = self.watches.pop(0)
        for item in script:
            if isinstance(item, Exception):
                raise item
            yield item


def run(lists, watches):
    listed, changed, events = [], [], []
    watch = NodeWatch(None, listed.append, lambda n, v: changed.append((n, v)), lambda: events.append(1))
    kube = ScriptedKube(lists, watches, watch)
    watch.kube = kube
    watch.run()
    return listed, changed, events, kube


def test_changes_names_new_changed_and_gone_nodes_only():
    up, down = NodeView(ready=True), NodeView(ready=False, since="2026-01-01T00:00:00Z")
    assert changes({"a": up, "b": up, "c": up}, {"a": up, "b": down, "d": up}) == {"b": down, "c": None, "d": up}
    assert changes({"a": up}, {"a": NodeView(ready=True)}) == {}


def test_heartbeats_are_counted_not_passed_on_and_readiness_changes_are():
    lists = [([node("a", "1"), node("b", "2")], "10")]
    watches = [[
        ("MODIFIED", node("a", "11", beat="t1")),  # a heartbeat: same readiness
        ("BOOKMARK", {"metadata": {"resourceVersion": "12"}}),
        ("MODIFIED", node("b", "13", ready=False)),
        ("MODIFIED", node("b", "14", ready=False, beat="t2")),  # still not Ready since the same time
        ("DELETED", node("a", "15")),
        ("ADDED", node("c", "16")),
    ]]  # fmt: skip
    listed, changed, events, kube = run(lists, watches)
    assert listed == [{"a": NodeView(ready=True), "b": NodeView(ready=True)}]
    assert changed == [("b", NodeView(ready=False, since="2026-01-01T00:00:00Z")), ("a", None),
                       ("c", NodeView(ready=True))]  # fmt: skip
    assert len(events) == 5  # the bookmark is not an event
    assert kube.started_from == ["10", "16"]  # the next watch resumes where the last ended


def test_not_ready_then_unknown_keeps_the_first_time_the_node_stopped_being_ready():
    """The node lifecycle controller turns a NotReady node Unknown with a new transition time: nodeLostSeconds
    counts from when it first went down, through a watch event and a listing alike; Ready starts afresh."""
    first, later, again = "2026-01-01T00:00:00Z", "2026-01-01T00:00:40Z", "2026-01-01T00:05:00Z"
    lists = [([node("a", "1", ready=False, since=first)], "10"),
             ([node("a", "30", ready=None, since=again)], "30")]  # fmt: skip
    watches = [[
        ("MODIFIED", node("a", "11", ready=None, since=later)),
        ("MODIFIED", node("a", "12", ready=True, since=later)),
        ("MODIFIED", node("a", "13", ready=None, since=again)),
        ("MODIFIED", node("a", "14", ready=False, since="2026-01-01T00:06:00Z")),
        Expired("gone"),
    ]]  # fmt: skip
    listed, changed, _, _ = run(lists, watches)
    down = NodeView(ready=False, since=first)
    assert listed == [{"a": down}, {}]  # the second listing: Unknown since later, still down since `again`
    assert changed == [("a", NodeView(ready=True)), ("a", NodeView(ready=False, since=again))]


def test_a_dropped_watch_resumes_from_the_last_version_seen(monkeypatch):
    monkeypatch.setattr("sharded_operator.run.nodewatch.RETRY_SECONDS", (0.01, 0.01))
    lists = [([node("a", "1")], "10")]
    watches = [[("MODIFIED", node("a", "11", ready=False)), ConnectionResetError("dropped")],
               [("MODIFIED", node("a", "12"))]]  # fmt: skip
    listed, changed, _, kube = run(lists, watches)
    assert len(listed) == 1  # not listed again
    assert kube.started_from == ["10", "11", "12"]
    assert [v.ready for _, v in changed] == [False, True]


def test_an_expired_watch_lists_again_and_reports_only_what_changed_meanwhile():
    lists = [
        ([node("a", "1"), node("b", "2"), node("c", "3")], "10"),
        ([node("a", "30"), node("b", "31", ready=False)], "40"),
    ]  # c deleted, b NotReady while away
    watches = [[("MODIFIED", node("a", "11", beat="t1")), Expired("too old")]]
    listed, changed, _, kube = run(lists, watches)
    assert listed[1] == {"b": NodeView(ready=False, since="2026-01-01T00:00:00Z"), "c": None}
    assert changed == []
    assert kube.started_from == ["10", "40"]


def test_an_event_that_cannot_be_read_lists_again_instead_of_resuming_into_it(monkeypatch, caplog):
    # Resuming from the version before such an event would bring it back on every try.
    monkeypatch.setattr("sharded_operator.run.nodewatch.RETRY_SECONDS", (0.01, 0.01))
    lists = [([node("a", "1"), node("b", "2")], "10"),
             ([node("a", "20", ready=False), node("b", "21")], "30")]  # fmt: skip
    watches = [[("MODIFIED", node("b", "11", ready=False)),
                ("MODIFIED", {"metadata": {"resourceVersion": "12"}, "status": {}})]]  # fmt: skip
    listed, changed, _, kube = run(lists, watches)
    assert kube.started_from == ["10", "30"]
    not_ready = NodeView(ready=False, since="2026-01-01T00:00:00Z")
    assert changed == [("b", not_ready)]
    assert listed[1] == {"a": not_ready, "b": NodeView(ready=True)}  # what the skipped event may have said
    (record,) = [r for r in caplog.records if r.name == "sharded_operator.run.nodewatch" and r.levelname != "INFO"]
    assert record.levelname == "WARNING" and "could not be read" in record.getMessage() and not record.exc_info


def test_a_watch_failing_again_and_again_at_one_version_lists_again(monkeypatch, caplog):
    monkeypatch.setattr("sharded_operator.run.nodewatch.RETRY_SECONDS", (0.01, 0.01))
    lists = [([node("a", "1")], "10"), ([node("a", "40")], "40")]
    watches = [[RuntimeError("refused")]] * STUCK_AFTER
    listed, _, _, kube = run(lists, watches)
    assert kube.started_from == ["10"] * STUCK_AFTER + ["40"]
    assert listed == [{"a": NodeView(ready=True)}, {}]
    failed = [r for r in caplog.records if r.getMessage().startswith("watching nodes failed")]
    assert len(failed) == STUCK_AFTER and all(r.exc_info for r in failed)  # a fault here: its traceback


def test_nodes_without_a_name_or_a_readable_status_neither_break_the_listing_nor_count_as_lost():
    odd = node("c", "3")
    odd["status"] = {"conditions": "Ready"}  # not a list of objects
    lists = [([node("a", "1"), {"metadata": {}}, odd], "10")]
    listed, *_ = run(lists, [])
    assert listed == [{"a": NodeView(ready=True), "c": NodeView(ready=False)}]  # not Ready, since unknown
    bad_time = {"type": "Ready", "status": "False", "lastTransitionTime": "yesterday"}
    assert NodeView.from_node({"status": {"conditions": [bad_time]}}) == NodeView(ready=False)


class Streamed:
    def __init__(self, body: bytes):
        self.body = body

    def stream(self, size):
        yield from (self.body[i : i + 7] for i in range(0, len(self.body), 7))  # lines split across chunks

    def release_conn(self):
        pass


@pytest.mark.parametrize("bad", [b"{not json", b'{"type": "MODIFIED"}', b"[1, 2]"])
def test_the_client_raises_malformed_on_a_line_that_is_not_an_event(bad):
    good = json.dumps({"type": "MODIFIED", "object": node("a", "11")}).encode()
    kube = Kube(SimpleNamespace(request=lambda *a, **kw: Streamed(good + b"\n\n" + bad + b"\n")))
    events = kube.watch_nodes("10", 5)
    assert next(events) == ("MODIFIED", node("a", "11"))
    with pytest.raises(Malformed):
        next(events)
