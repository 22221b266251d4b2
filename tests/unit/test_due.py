"""next_due: the operator looks at a job again exactly when a rule that reads the clock could decide otherwise.

Each case decides once at NOW, then decides again on the decided status just before the due time (the
same verdict) and at it (another verdict): a due time too late would leave a hang or a lost node unseen
until the safety-net resync, one too early costs a reconcile that changes nothing.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest

from sharded_api.contract import iso
from sharded_operator.decide.due import next_due
from sharded_operator.decide.lifecycle import decide
from sharded_operator.decide.views import NodeView, Observed, PodView
from support.jobs import make_job

NOW = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)
GRACE = {"restart": 30, "suspend": 120}


def ago(seconds: float) -> str:
    return iso(NOW - dt.timedelta(seconds=seconds))


def pods(n: int = 2, phase: str = "Running", **fields) -> list[PodView]:
    return [PodView(name=f"j-{i}", index=i, attempt=1, phase=phase, node=f"node-{i}", uid=f"p{i}", **fields)
            for i in range(n)]  # fmt: skip


def running(**status):
    cond = {"type": "Running", "status": "True", "reason": "AllNodesRunning", "lastTransitionTime": ago(100)}
    return make_job().nodes(2).status(
        **{"attempt": 1, "phase": "Running", "startTime": ago(3600), "activeSince": ago(3600), "conditions": [cond],
           "desiredNodes": 2, **status}
    )  # fmt: skip


def verdict(plan) -> tuple:
    failure = plan.status.last_failure.reason if plan.status.last_failure else None
    events = tuple(sorted(reason for _, reason, _ in plan.events))
    return plan.status.phase, failure, sorted(plan.delete), sorted(plan.force_delete), plan.delete_job, events


def check(builder, obs: Observed) -> dt.datetime:
    """The due time of the job as decided at NOW; asserts the decision holds until then and changes at it."""
    job = builder.model()
    plan = decide(job, obs, NOW, GRACE)
    due = next_due(job, plan.status, obs, NOW)
    assert due is not None and due > NOW
    decided = job.model_copy(update={"status": plan.status})
    steady = verdict(decide(decided, obs, NOW, GRACE))
    assert verdict(decide(decided, obs, due - dt.timedelta(seconds=1), GRACE)) == steady
    assert verdict(decide(decided, obs, due, GRACE)) != steady
    return due


CASES = {
    "hang": (running(progress={"step": 3, "attempt": 1, "observedAt": ago(10), "updatedAt": ago(10)})
             .spec("failurePolicy.hangTimeoutSeconds", 600), Observed(pods=pods()), 590),
    "startup timeout": (running().spec("failurePolicy.startupTimeoutSeconds", 600), Observed(pods=pods()), 500),
    # The operator has heard reports only for 30 s (it just started, or took the Lease): the timers count from then.
    "hang after an outage": (running(progress={"step": 3, "attempt": 1, "observedAt": ago(900), "updatedAt": ago(900)})
                             .spec("failurePolicy.hangTimeoutSeconds", 600),
                             Observed(pods=pods(), hearing_since=ago(30)), 570),
    "startup after an outage": (running().spec("failurePolicy.startupTimeoutSeconds", 600),
                                Observed(pods=pods(), hearing_since=ago(30)), 570),
    "active deadline": (running(activeSince=ago(500)).spec("runPolicy.activeDeadlineSeconds", 600),
                        Observed(pods=pods()), 100),
    "node lost": (running(),
                  Observed(pods=pods(), nodes={"node-0": NodeView(True), "node-1": NodeView(False, ago(20))}), 40),
    "pod missing": (running(), Observed(pods=pods(1), missing_since={"j-1": ago(2)}), 3),
    "pod stuck": (make_job().nodes(2).status(attempt=1, phase="Starting", startTime=ago(10), activeSince=ago(10))
                  .spec("failurePolicy.schedulingTimeoutSeconds", 30),
                  Observed(pods=pods(phase="Pending", stuck="Unschedulable: 0/3 nodes", stuck_since=ago(5))), 25),
    "ttl": (make_job().nodes(2).status(attempt=1, phase="Succeeded", startTime=ago(900), completionTime=ago(100))
            .spec("runPolicy.ttlSecondsAfterFinished", 300), Observed(pods=[]), 200),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_the_next_look_is_when_a_clock_rule_changes_the_decision(case):
    builder, obs, seconds = CASES[case]
    due = check(builder, obs)
    assert abs((due - NOW).total_seconds() - seconds) < 1, due


def test_the_nearest_of_several_rules_comes_first():
    job = running(activeSince=ago(500)).spec("runPolicy.activeDeadlineSeconds", 600)
    obs = Observed(pods=pods(), nodes={"node-0": NodeView(True), "node-1": NodeView(False, ago(30))})
    assert abs((check(job, obs) - NOW).total_seconds() - 30) < 1


def test_a_pod_stuck_terminating_on_a_lost_node_is_forced_out_when_its_grace_ends():
    gone = [dataclasses.replace(p, deleting=True, grace_ends=ago(-20)) for p in pods()]
    obs = Observed(pods=gone, nodes={"node-0": NodeView(False, ago(600)), "node-1": NodeView(False, ago(600))})
    job = make_job().nodes(2).status(attempt=1, phase="Failed", startTime=ago(900), completionTime=ago(10))
    assert abs((check(job, obs) - NOW).total_seconds() - 20) < 1


def test_a_pod_left_terminating_by_a_deleted_node_is_forced_out_when_its_grace_ends():
    """A deleted node is lost at once, and no kubelet will confirm its pods gone: the next look is when their
    grace ends (nothing else may happen before it; the pod garbage collector waits 40 s and more)."""
    gone = [dataclasses.replace(p, deleting=True, grace_ends=ago(-3)) for p in pods()]
    obs = Observed(pods=gone, nodes={"node-0": NodeView(True)})  # node-1 is gone
    job = running(phase="Restarting", attempt=2)
    assert abs((check(job, obs) - NOW).total_seconds() - 3) < 1
    assert next_due(job.model(), job.model().status, dataclasses.replace(obs, nodes=None), NOW) is None  # unseen


@pytest.mark.parametrize("builder,obs", [
    (running(), Observed(pods=pods())),  # no timeouts set: only events can change anything
    (make_job().nodes(2).status(attempt=1, phase="Succeeded", completionTime=ago(10)), Observed(pods=[])),  # no TTL
    (running().spec("runPolicy.suspend", True).spec("runPolicy.activeDeadlineSeconds", 60), Observed(pods=[])),
])  # fmt: skip
def test_a_job_that_only_events_can_change_is_never_polled(builder, obs):
    job = builder.model()
    plan = decide(job, obs, NOW, GRACE)
    assert next_due(job, plan.status, obs, NOW) is None


def node(status: str, moved: str) -> dict:
    return {"status": {"conditions": [{"type": "Ready", "status": status, "lastTransitionTime": moved,
                                       "lastHeartbeatTime": moved}]}}  # fmt: skip


def test_a_heartbeat_of_a_ready_node_is_no_news_but_losing_readiness_is():
    """A node agent that moves lastTransitionTime on every heartbeat must not wake the node's jobs."""
    assert NodeView.from_node(node("True", ago(10))) == NodeView.from_node(node("True", ago(0))) == NodeView(True)
    lost = NodeView.from_node(node("Unknown", ago(30)))
    assert lost == NodeView(False, ago(30)) and lost != NodeView.from_node(node("Unknown", ago(0)))
