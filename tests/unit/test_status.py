"""Lifecycle decisions as tables: (job status, observed pods) -> phase, actions, restarts, lastFailure."""

from __future__ import annotations

import datetime as dt

import pytest

from sharded_api.contract import iso
from sharded_operator.decide.lifecycle import decide
from sharded_operator.decide.views import NodeView, Observed, PodView
from support.jobs import make_job

NOW = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)
GRACE = {"restart": 30, "suspend": 120}


def pods(n: int, phase: str = "Running", attempt: int = 1, **overrides) -> list[PodView]:
    return [
        PodView(name=f"j-{i}", index=i, attempt=attempt, phase=phase, node=f"node-{i}", **overrides) for i in range(n)
    ]


def running(**status):
    return make_job().nodes(2).status(**{"attempt": 1, "phase": "Running", "startTime": iso(NOW), **status})


def test_new_job_creates_every_pod_as_attempt_one():
    plan = decide(make_job().nodes(3).model(), Observed(pods=[]), NOW, GRACE)
    assert plan.create == [0, 1, 2]
    assert plan.status.attempt == 1 and plan.status.phase == "Starting"
    assert plan.status.start_time == iso(NOW)
    assert {c.type for c in plan.status.conditions} >= {"Created", "Running", "Failed"}


def test_partially_running_is_starting_then_running():
    job = make_job().nodes(2).status(attempt=1, phase="Starting").model()
    mixed = [pods(1)[0], PodView(name="j-1", index=1, attempt=1, phase="Pending")]
    plan = decide(job, Observed(pods=mixed), NOW, GRACE)
    assert plan.status.phase == "Starting" and plan.status.ready == "1/2" and plan.create == []
    plan = decide(job, Observed(pods=pods(2)), NOW, GRACE)
    assert plan.status.phase == "Running" and plan.status.ready == "2/2"


def test_all_pods_succeeded_is_success():
    plan = decide(running().model(), Observed(pods=pods(2, "Succeeded")), NOW, GRACE)
    assert plan.status.phase == "Succeeded" and plan.status.completion_time == iso(NOW)
    conditions = {c.type: c.status for c in plan.status.conditions}
    assert conditions["Succeeded"] == conditions["Complete"] == "True" and conditions["Running"] == "False"


def test_an_interactive_session_runs_until_jupyterlab_on_node_0_exits():
    job = running().spec("interactive", {"port": 8888}).model()
    plan = decide(job, Observed(pods=pods(2)), NOW, GRACE)
    assert plan.status.phase == "Running" and "JupyterLab on node 0 port 8888" in plan.status.message
    lab_done = pods(2)
    lab_done[0] = PodView(name="j-0", index=0, attempt=1, phase="Succeeded", node="node-0")
    plan = decide(job, Observed(pods=lab_done), NOW, GRACE)
    assert plan.status.phase == "Succeeded" and plan.delete == ["j-1"]
    assert ("Normal", "Succeeded", "the interactive session ended after 0 restarts") in plan.events
    # JupyterLab failing is a failure like any other: the gang restarts.
    lab_failed = pods(2)
    lab_failed[0] = PodView(name="j-0", index=0, attempt=1, phase="Failed", node="node-0", exit_code=1, reason="Error")
    assert decide(job, Observed(pods=lab_failed), NOW, GRACE).status.phase == "Restarting"


def test_complete_stays_false_until_success():
    plan = decide(running().model(), Observed(pods=pods(2)), NOW, GRACE)
    assert {c.type: c.status for c in plan.status.conditions}["Complete"] == "False"


@pytest.mark.parametrize(
    "failed_pod,restarts,backoff,expected_phase,reason",
    [
        (dict(exit_code=1, reason="Error"), 0, 3, "Restarting", "Error"),
        (dict(exit_code=137, reason="OOMKilled"), 0, 3, "Restarting", "OOMKilled"),
        (dict(exit_code=2, reason="Error"), 0, 3, "Failed", "PermanentFailure"),  # 2 is permanent by default
        (dict(exit_code=1, reason="Error"), 3, 3, "Failed", "BackoffLimitExceeded"),
    ],
)
def test_failed_pod_restarts_the_gang_or_fails_the_job(failed_pod, restarts, backoff, expected_phase, reason):
    job = running(restarts=restarts).spec("failurePolicy.backoffLimit", backoff).model()
    observed = pods(2)
    observed[1] = PodView(name="j-1", index=1, attempt=1, phase="Failed", node="node-1", **failed_pod)
    plan = decide(job, Observed(pods=observed), NOW, GRACE)
    assert plan.status.phase == expected_phase
    failure = plan.status.last_failure
    assert (failure.pod, failure.node, failure.node_rank, failure.exit_code) == (
        "j-1",
        "node-1",
        1,
        failed_pod["exit_code"],
    )
    assert failure.reason == failed_pod["reason"]
    if expected_phase == "Restarting":
        assert plan.status.restarts == restarts + 1 and plan.status.attempt == 2
        assert sorted(plan.delete) == ["j-0", "j-1"] and plan.grace_seconds == 30
        assert plan.create == []  # the new gang waits until the old one is gone
    else:
        assert next(c for c in plan.status.conditions if c.type == "Failed").reason == reason
        assert plan.status.restarts == restarts


def test_retryable_exit_codes_narrow_what_restarts():
    job = running().spec("failurePolicy.retryableExitCodes", [137]).model()
    observed = [pods(1)[0], PodView(name="j-1", index=1, attempt=1, phase="Failed", exit_code=1)]
    assert decide(job, Observed(pods=observed), NOW, GRACE).status.phase == "Failed"


def test_next_attempt_starts_only_after_the_old_pods_are_gone():
    job = make_job().nodes(2).status(attempt=2, phase="Restarting", restarts=1).model()
    old = pods(2, "Failed", attempt=1, deleting=True)
    plan = decide(job, Observed(pods=old), NOW, GRACE)
    assert plan.create == [] and plan.status.phase == "Restarting"
    plan = decide(job, Observed(pods=[]), NOW, GRACE)
    assert plan.create == [0, 1] and plan.status.attempt == 2


@pytest.mark.parametrize(
    "observed,reason",
    [
        (pods(1), "PodDeleted"),  # j-1 vanished while running, long enough ago (missing_since below)
        ([*pods(1), PodView(name="j-1", index=1, attempt=1, phase="Running", deleting=True)], "PodDeleted"),
        ([*pods(1), PodView(name="j-1", index=1, attempt=1, phase="Running", node="gone")], "NodeLost"),
    ],
    ids=["missing", "being-deleted", "node-gone"],
)
def test_lost_pods_and_nodes_restart_the_gang(observed, reason):
    missing = {"j-1": iso(NOW - dt.timedelta(seconds=30))}
    nodes = {"node-0": NodeView(), "node-1": NodeView()}
    plan = decide(running().model(), Observed(pods=observed, nodes=nodes, missing_since=missing), NOW, GRACE)
    assert plan.status.phase == "Restarting" and plan.status.last_failure.reason == reason
    assert plan.status.last_failure.exit_code is None


def test_suspend_deletes_pods_with_the_checkpoint_grace_and_resume_starts_a_new_attempt():
    job = running().spec("runPolicy.suspend", True).model()
    plan = decide(job, Observed(pods=pods(2)), NOW, GRACE)
    assert plan.status.phase == "Suspended" and sorted(plan.delete) == ["j-0", "j-1"] and plan.grace_seconds == 120
    resumed = make_job().nodes(2).status(attempt=1, phase="Suspended").model()
    plan = decide(resumed, Observed(pods=[]), NOW, GRACE)
    assert plan.status.attempt == 2 and plan.create == [0, 1] and plan.status.restarts == 0


def test_active_deadline_fails_the_job():
    start = iso(NOW - dt.timedelta(seconds=601))
    job = running(startTime=start).spec("runPolicy.activeDeadlineSeconds", 600).model()
    plan = decide(job, Observed(pods=pods(2)), NOW, GRACE)
    assert plan.status.phase == "Failed" and plan.status.message.startswith("active for more than 600s")
    assert sorted(plan.delete) == ["j-0", "j-1"]  # cleanPodPolicy Running


@pytest.mark.parametrize("policy,expected", [("None", []), ("Running", ["j-1"]), ("All", ["j-0", "j-1"])])
def test_clean_pod_policy_after_the_end(policy, expected):
    job = make_job().nodes(2).status(attempt=1, phase="Failed", completionTime=iso(NOW))
    job = job.spec("runPolicy.cleanPodPolicy", policy).model()
    observed = [PodView(name="j-0", index=0, attempt=1, phase="Failed"), pods(2)[1]]
    assert sorted(decide(job, Observed(pods=observed), NOW, GRACE).delete) == expected


def test_ttl_deletes_the_finished_job():
    done = iso(NOW - dt.timedelta(seconds=61))
    job = make_job().status(attempt=1, phase="Succeeded", completionTime=done)
    assert decide(job.spec("runPolicy.ttlSecondsAfterFinished", 60).model(), Observed([]), NOW, GRACE).delete_job
    assert not decide(job.spec("runPolicy.ttlSecondsAfterFinished", 120).model(), Observed([]), NOW, GRACE).delete_job


def test_decide_is_idempotent():
    job = running().model()
    first = decide(job, Observed(pods=pods(2)), NOW, GRACE)
    job.status = first.status
    second = decide(job, Observed(pods=pods(2)), NOW, GRACE)
    assert second.status == first.status and not second.create and not second.delete and not second.events
