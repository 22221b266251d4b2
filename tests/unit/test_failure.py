"""Failure policy as tables: hangs on the operator's clock, disruptions apart from failures, which failure is
reported, and the deadline across suspension."""

from __future__ import annotations

import datetime as dt

import pytest

from sharded_api.contract import ProgressReport, iso
from sharded_operator.api.status import ShardedTrainingJobStatus
from sharded_operator.decide.lifecycle import decide
from sharded_operator.decide.progress import merge_report
from sharded_operator.decide.views import NodeView, Observed, PodView
from support.jobs import make_job

NOW = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)
GRACE = {"restart": 30, "suspend": 120}


def ago(seconds: float) -> str:
    return iso(NOW - dt.timedelta(seconds=seconds))


def pods(n: int, phase: str = "Running", attempt: int = 1) -> list[PodView]:
    return [PodView(name=f"j-{i}", index=i, attempt=attempt, phase=phase, node=f"node-{i}") for i in range(n)]


def running(attempt: int = 1, running_for: float = 60, **status):
    """A job whose attempt `attempt` has had every pod running for `running_for` seconds."""
    cond = {"type": "Running", "status": "True", "reason": "AllNodesRunning", "lastTransitionTime": ago(running_for)}
    return (
        make_job()
        .nodes(2)
        .status(**{"attempt": attempt, "phase": "Running", "startTime": ago(3600), "conditions": [cond], **status})
    )


def reported(attempt: int, seconds_ago: float, step: int = 5, updated_at: str | None = None) -> dict:
    """status.progress as the operator wrote it when it saw a report `seconds_ago`."""
    at = ago(seconds_ago)
    return {"step": step, "attempt": attempt, "updatedAt": updated_at or at, "observedAt": at}


def report(attempt: int, step: int, updated_at: str) -> ProgressReport:
    return ProgressReport.model_validate({
        "uid": "uid-j", "namespace": "default", "name": "j", "attempt": attempt, "run": "r", "step": step,
        "updatedAt": updated_at,
    })  # fmt: skip


def decide_on(job, observed: list[PodView] | None = None, progress: ProgressReport | None = None, nodes=None):
    """decide() on the job, after `progress` was written into its status as the operator writes reports."""
    model = job.model()
    if progress is not None:
        fields, _ = merge_report(model.status, progress, iso(NOW))
        status = model.status.model_dump(by_alias=True, exclude_none=True, mode="json")
        model.status = ShardedTrainingJobStatus.model_validate({**status, **fields})
    return decide(model, Observed(pods=pods(2) if observed is None else observed, nodes=nodes), NOW, GRACE)


# --- hangs -------------------------------------------------------------------------------------------


def test_an_attempt_that_stops_reporting_is_restarted_as_hung():
    job = running(progress=reported(1, 400)).spec("failurePolicy.hangTimeoutSeconds", 300)
    plan = decide_on(job)
    assert plan.status.phase == "Restarting" and plan.status.last_failure.reason == "Hang"
    assert plan.status.restarts == 1  # a hang is a failure, not a disruption


def test_a_new_report_resets_the_hang_timer_on_the_operators_clock():
    job = running(progress=reported(1, 400)).spec("failurePolicy.hangTimeoutSeconds", 300)
    plan = decide_on(job, progress=report(1, step=6, updated_at=ago(400)))  # the trainer's clock is behind
    assert plan.status.phase == "Running" and plan.status.progress.observed_at == iso(NOW)
    # The same report seen again does not count as progress.
    job = running(progress=reported(1, 400, step=6)).spec("failurePolicy.hangTimeoutSeconds", 300)
    same = decide_on(job, progress=report(1, step=6, updated_at=ago(400)))
    assert same.status.phase == "Restarting"


def test_a_trainer_clock_in_the_future_does_not_hide_a_hang():
    job = running(progress=reported(1, 400, updated_at="2099-01-01T00:00:00Z"))
    assert decide_on(job.spec("failurePolicy.hangTimeoutSeconds", 300)).status.last_failure.reason == "Hang"


@pytest.mark.parametrize(
    "case,status",
    [
        # resumed after a suspension longer than the timeout: the report is the previous attempt's
        ("after-resume", {"attempt": 2, "progress": reported(1, 5000)}),
        # restarted after a hang: the new attempt has not reported yet
        ("after-hang-restart", {"attempt": 3, "restarts": 1, "progress": reported(2, 900)}),
        # a custom script that never reports
        ("never-reports", {"attempt": 1}),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_an_attempt_that_has_not_reported_is_never_hung(case, status):
    job = running(running_for=5000, **status).spec("failurePolicy.hangTimeoutSeconds", 300)
    plan = decide_on(job, pods(2, attempt=status["attempt"]))
    assert plan.status.phase == "Running", plan.status.message


def test_the_hang_and_startup_timers_count_only_time_the_operator_could_hear():
    """After an outage of the operator (or of the API server, or a standby taking over) longer than the
    timeouts, silence from before it proves nothing: the timers start again when hearing did."""
    hung = running(progress=reported(1, 900)).spec("failurePolicy.hangTimeoutSeconds", 300)
    assert decide(hung.model(), Observed(pods=pods(2)), NOW, GRACE).status.last_failure.reason == "Hang"
    back = Observed(pods=pods(2), hearing_since=ago(200))
    assert decide(hung.model(), back, NOW, GRACE).status.phase == "Running"
    long_back = Observed(pods=pods(2), hearing_since=ago(301))
    assert decide(hung.model(), long_back, NOW, GRACE).status.last_failure.reason == "Hang"
    never = running(running_for=5000).spec("failurePolicy.startupTimeoutSeconds", 600)
    assert decide(never.model(), Observed(pods=pods(2), hearing_since=ago(500)), NOW, GRACE).status.phase == "Running"
    assert decide(never.model(), Observed(pods=pods(2), hearing_since=ago(601)), NOW,
                  GRACE).status.last_failure.reason == "StartupTimeout"  # fmt: skip


def test_startup_timeout_bounds_the_wait_for_the_first_report():
    job = running(running_for=700).spec("failurePolicy.startupTimeoutSeconds", 600)
    plan = decide_on(job)
    assert plan.status.phase == "Restarting" and plan.status.last_failure.reason == "StartupTimeout"
    early = running(running_for=500).spec("failurePolicy.startupTimeoutSeconds", 600)
    assert decide_on(early).status.phase == "Running"
    reporting = running(running_for=700, progress=reported(1, 10)).spec("failurePolicy.startupTimeoutSeconds", 600)
    assert decide_on(reporting).status.phase == "Running"


# --- disruptions --------------------------------------------------------------------------------------


def evicted(index: int = 1) -> PodView:
    return PodView(
        name=f"j-{index}", index=index, attempt=1, phase="Running", node=f"node-{index}", deleting=True,
        disruption="EvictionByEvictionAPI: Eviction API: evicting", deleted_at=ago(5),
    )  # fmt: skip


@pytest.mark.parametrize(
    "victim,reason",
    [
        (evicted(), "DisruptionTarget"),
        (PodView(name="j-1", index=1, attempt=1, phase="Failed", node="node-1", exit_code=75, reason="Error"), "Error"),
        (PodView(name="j-1", index=1, attempt=1, phase="Running", node="gone"), "NodeLost"),
        (PodView(name="j-1", index=1, attempt=1, phase="Failed", node="node-1", reason="Evicted"), "Evicted"),
    ],
    ids=["eviction", "stopped-after-checkpoint", "node-lost", "kubelet-eviction"],
)
def test_a_disruption_restarts_without_using_the_failure_budget(victim, reason):
    job = running(restarts=3).spec("failurePolicy.backoffLimit", 3)
    plan = decide_on(job, [pods(1)[0], victim], nodes={"node-0": NodeView(), "node-1": NodeView()})
    assert plan.status.phase == "Restarting", plan.status.message
    assert (plan.status.restarts, plan.status.disruptions, plan.status.attempt) == (3, 1, 2)
    assert plan.status.last_failure.reason == reason
    counting = job.spec("failurePolicy.countDisruptions", True)
    counted = decide_on(counting, [pods(1)[0], victim], nodes={"node-0": NodeView(), "node-1": NodeView()})
    assert counted.status.phase == "Failed" and counted.status.message.endswith("3 restarts used")


def test_a_pod_deleted_by_a_person_is_a_failure():
    deleted = PodView(name="j-1", index=1, attempt=1, phase="Running", node="node-1", deleting=True)
    plan = decide_on(running(), [pods(1)[0], deleted])
    assert plan.status.restarts == 1 and plan.status.disruptions == 0


def test_a_permanent_exit_code_anywhere_wins_over_an_earlier_failure():
    gang = [
        PodView(name="j-0", index=0, attempt=1, phase="Running", node="node-0", deleting=True, deleted_at=ago(60)),
        *pods(4)[1:3],
        PodView(name="j-3", index=3, attempt=1, phase="Failed", node="node-3", exit_code=2, finished_at=ago(1)),
    ]
    plan = decide_on(running().nodes(4), gang)
    assert plan.status.phase == "Failed" and plan.status.last_failure.pod == "j-3"


def test_the_first_failure_in_time_is_the_one_reported():
    gang = [
        PodView(name="j-0", index=0, attempt=1, phase="Failed", node="node-0", exit_code=1, finished_at=ago(1)),
        PodView(name="j-1", index=1, attempt=1, phase="Failed", node="node-1", exit_code=137, finished_at=ago(9)),
    ]
    failure = decide_on(running(), gang).status.last_failure
    assert (failure.pod, failure.exit_code, failure.time) == ("j-1", 137, ago(9))


# --- the deadline -------------------------------------------------------------------------------------


def test_active_deadline_does_not_count_suspended_time():
    suspended = make_job().nodes(2).status(attempt=1, phase="Suspended", startTime=ago(5000), activeSince=ago(5000))
    plan = decide_on(suspended.spec("runPolicy.activeDeadlineSeconds", 600), [])
    assert plan.status.phase == "Starting" and plan.status.active_since == iso(NOW) and plan.create == [0, 1]
    still = running(startTime=ago(5000), activeSince=ago(500)).spec("runPolicy.activeDeadlineSeconds", 600)
    assert decide_on(still).status.phase == "Running"
    late = running(startTime=ago(5000), activeSince=ago(700)).spec("runPolicy.activeDeadlineSeconds", 600)
    assert decide_on(late).status.phase == "Failed"


# --- what the API server says about a pod ---------------------------------------------------------------


def test_pod_view_reads_disruption_termination_and_deletion_times():
    pod = {
        "metadata": {
            "name": "j-1", "labels": {"training.sharded.dev/node-index": "1", "training.sharded.dev/attempt": "2"},
            "deletionTimestamp": "2026-01-01T12:00:30Z", "deletionGracePeriodSeconds": 30,
        },
        "spec": {"nodeName": "n1"},
        "status": {
            "phase": "Failed",
            "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler",
                            "message": "preempted by a higher-priority pod"}],
            "containerStatuses": [{"name": "trainer", "state": {"terminated": {
                "exitCode": 75, "reason": "Error", "finishedAt": "2026-01-01T12:00:10Z"}}}],
        },
    }  # fmt: skip
    view = PodView.from_pod(pod)
    assert (view.index, view.attempt, view.exit_code) == (1, 2, 75)
    assert view.disruption == "PreemptionByScheduler: preempted by a higher-priority pod"
    assert view.finished_at == "2026-01-01T12:00:10Z" and view.deleted_at == "2026-01-01T12:00:00Z"


# --- refusals by the API server -------------------------------------------------------------------------


def test_a_refused_create_sets_a_condition_and_one_event_until_creates_go_through():
    from sharded_operator.decide.plan import record_refusal

    plan = decide_on(running(), [])
    record_refusal(plan, ("Forbidden", "Pod j-0: exceeded quota: pods=1"), iso(NOW))
    cond = next(c for c in plan.status.conditions if c.type == "CreateRefused")
    assert (cond.status, cond.reason, cond.message) == ("True", "Forbidden", "Pod j-0: exceeded quota: pods=1")
    assert ("Warning", "FailedCreate", "Pod j-0: exceeded quota: pods=1") in plan.events
    assert "exceeded quota" in plan.status.message

    again = decide_on(make_job().nodes(2).status(**plan.status.model_dump(by_alias=True, mode="json")), [])
    record_refusal(again, ("Forbidden", "Pod j-0: exceeded quota: pods=1"), iso(NOW))
    assert not [e for e in again.events if e[1] == "FailedCreate"], "the same refusal is announced once"
    record_refusal(again, None, iso(NOW))
    assert next(c for c in again.status.conditions if c.type == "CreateRefused").status == "False"


def test_a_pod_deleted_at_once_is_judged_by_its_last_state():
    """No kubelet, or grace 0: the pod is gone before any list shows it Terminating; its deletion event
    carried why."""
    last = PodView(name="j-1", index=1, attempt=1, phase="Running", node="node-1", disruption="DeletionByPodGC: x")
    plan = decide(running().model(), Observed(pods=pods(1), departed={"j-1": last}), NOW, GRACE)
    assert (plan.status.restarts, plan.status.disruptions) == (0, 1)
    assert plan.status.last_failure.reason == "DisruptionTarget" and plan.status.last_failure.node == "node-1"
    stale = PodView(name="j-1", index=1, attempt=0, phase="Running", disruption="DeletionByPodGC: x")
    plan = decide(running().model(), Observed(pods=pods(1), departed={"j-1": stale}), NOW, GRACE)
    assert plan.status.phase == "Running", "a previous attempt's departure says nothing about this one"
    long_gone = Observed(pods=pods(1), departed={"j-1": stale}, missing_since={"j-1": ago(10)})
    assert decide(running().model(), long_gone, NOW, GRACE).status.restarts == 1


def test_a_vanished_pod_waits_briefly_for_its_deletion_event_then_counts():
    """The list can show a pod gone before the watch delivers the event that says why it went."""
    assert decide(running().model(), Observed(pods=pods(1)), NOW, GRACE).status.phase == "Running"
    just = Observed(pods=pods(1), missing_since={"j-1": ago(2)})
    assert decide(running().model(), just, NOW, GRACE).status.phase == "Running"
    gone = decide(running().model(), Observed(pods=pods(1), missing_since={"j-1": ago(6)}), NOW, GRACE)
    assert gone.status.last_failure.reason == "PodDeleted" and gone.status.restarts == 1


def test_a_pod_that_went_while_the_operator_was_not_watching_is_a_disruption():
    """Gone before this process first looked (an eviction during an operator outage): why is not known, so it
    does not use backoffLimit; a pod seen to vanish later, its deletion event lost, still counts."""
    away = Observed(pods=pods(1), missing_since={"j-1": ago(6)}, unwatched=frozenset({"j-1"}))
    job = running(restarts=3).spec("failurePolicy.backoffLimit", 3)
    plan = decide(job.model(), away, NOW, GRACE)
    assert plan.status.phase == "Restarting" and plan.status.last_failure.reason == "PodVanished"
    assert (plan.status.restarts, plan.status.disruptions) == (3, 1)
    assert "not watching" in plan.status.last_failure.message
    seen = decide(job.model(), Observed(pods=pods(1), missing_since={"j-1": ago(6)}), NOW, GRACE)
    assert seen.status.last_failure.reason == "PodDeleted" and seen.status.phase == "Failed"


# --- lost nodes ------------------------------------------------------------------------------------------


def node(ready: bool, seconds: float) -> NodeView:
    return NodeView(ready=ready, since=ago(seconds))


@pytest.mark.parametrize(
    "nodes,lost",
    [
        ({"node-0": node(True, 900)}, True),  # node-1 deleted
        ({"node-0": node(True, 900), "node-1": node(False, 61)}, True),  # NotReady past nodeLostSeconds
        ({"node-0": node(True, 900), "node-1": node(False, 30)}, False),  # a blip
        ({"node-0": node(True, 900), "node-1": node(True, 1)}, False),
    ],
    ids=["deleted", "not-ready-too-long", "not-ready-briefly", "ready"],
)
def test_a_node_is_lost_when_deleted_or_not_ready_for_node_lost_seconds(nodes, lost):
    plan = decide_on(running(), nodes=nodes)
    assert (plan.status.phase == "Restarting") is lost
    if lost:
        assert plan.status.last_failure.reason == "NodeLost" and plan.status.disruptions == 1


def test_pods_stuck_terminating_on_a_lost_node_are_force_deleted_after_their_grace():
    stuck = PodView(
        name="j-1", index=1, attempt=1, phase="Running", node="node-1", deleting=True, deleted_at=ago(40),
        grace_ends=ago(10),
    )  # fmt: skip
    lost = {"node-0": node(True, 900), "node-1": node(False, 120)}
    job = make_job().nodes(2).status(attempt=2, phase="Restarting", restarts=0, disruptions=1)
    plan = decide_on(job, [stuck], nodes=lost)
    assert plan.force_delete == ["j-1"] and plan.create == []  # the next attempt waits for the name
    assert ("Warning", "ForceDeleted", "pod j-1 is on a lost node: deleted without its grace") in plan.events
    in_grace = PodView(**{**stuck.__dict__, "grace_ends": iso(NOW + dt.timedelta(seconds=5))})
    assert decide_on(job, [in_grace], nodes=lost).force_delete == []
    healthy = {"node-0": node(True, 900), "node-1": node(True, 900)}
    assert decide_on(job, [stuck], nodes=healthy).force_delete == [], "a live kubelet finishes the deletion itself"


def test_node_view_reads_the_ready_condition():
    view = NodeView.from_node({"status": {"conditions": [
        {"type": "Ready", "status": "Unknown", "lastTransitionTime": "2026-01-01T11:58:00+00:00"}]}})  # fmt: skip
    assert (view.ready, view.since) == (False, "2026-01-01T11:58:00Z")
    assert NodeView.from_node({}).ready is False


def test_suspend_deletes_pods_with_the_jobs_own_grace():
    job = running().spec("runPolicy.suspend", True).spec("runPolicy.terminationGraceSeconds", 900)
    assert decide_on(job).grace_seconds == 900
    assert decide_on(running().spec("runPolicy.suspend", True)).grace_seconds == GRACE["suspend"]


# --- a name used again ---------------------------------------------------------------------------------


def test_pods_of_a_deleted_job_of_the_same_name_are_waited_out_never_adopted():
    fresh = make_job().nodes(2)
    plan = decide(fresh.model(), Observed(pods=[], foreign=["j-0", "j-1"]), NOW, GRACE)
    assert plan.create == [] and plan.delete == [] and plan.status.restarts == 0
    assert "of a deleted job of the same name" in plan.status.message
    assert decide(fresh.model(), Observed(pods=[]), NOW, GRACE).create == [0, 1]


def test_a_departure_of_another_job_of_the_same_name_says_nothing():
    theirs = PodView(name="j-1", index=1, attempt=1, phase="Running", disruption="DeletionByPodGC: x", owner_uid="old")
    observed = Observed(pods=pods(1), departed={"j-1": theirs}, missing_since={"j-1": ago(10)})
    plan = decide(running().model(), observed, NOW, GRACE)
    assert plan.status.last_failure.reason == "PodDeleted" and plan.status.disruptions == 0


# --- pods that cannot start -------------------------------------------------------------------------------


def unschedulable(index: int, since: float) -> PodView:
    why = "Unschedulable: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    return PodView(name=f"j-{index}", index=index, attempt=1, phase="Pending", stuck=why, stuck_since=ago(since))


def test_why_a_pod_does_not_start_shows_in_status_at_once():
    starting = make_job().nodes(2).status(attempt=1, phase="Starting", startTime=ago(5))
    plan = decide_on(starting, [pods(1)[0], unschedulable(1, 1)])
    assert plan.status.phase == "Starting" and "pod j-1: Unschedulable: 0/4 nodes" in plan.status.message
    assert not [c for c in plan.status.conditions if c.type == "PodsStuck"], "no timeout set: it waits quietly"


def test_a_gang_shows_the_member_that_cannot_be_placed_not_those_waiting_for_it():
    # Volcano's words for a gang of three where only the third does not fit (seen on the real scheduler).
    why = "Schedulable: Pod ns/j-0 can possibly be assigned to node-0, once minAvailable is satisfied"
    waiting = PodView(name="j-0", index=0, attempt=1, phase="Pending", stuck=why, stuck_since=ago(1))
    starting = make_job().nodes(2).status(attempt=1, phase="Starting", startTime=ago(5))
    plan = decide_on(starting, [waiting, unschedulable(1, 1)])
    assert "pod j-1: Unschedulable: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu" in plan.status.message
    plan = decide_on(starting, [waiting, PodView(name="j-1", index=1, attempt=1, phase="Pending")])
    assert "pod j-0: Schedulable: Pod ns/j-0 can possibly be assigned" in plan.status.message  # the only word


def test_a_pod_stuck_past_the_scheduling_timeout_raises_a_condition_and_one_event():
    starting = make_job().nodes(2).status(attempt=1, phase="Starting", startTime=ago(600))
    job = starting.spec("failurePolicy.schedulingTimeoutSeconds", 300)
    early = decide_on(job, [pods(1)[0], unschedulable(1, 200)])
    assert not [c for c in early.status.conditions if c.type == "PodsStuck"]
    plan = decide_on(job, [pods(1)[0], unschedulable(1, 400)])
    cond = next(c for c in plan.status.conditions if c.type == "PodsStuck")
    assert (cond.status, cond.reason) == ("True", "Unschedulable") and "stuck for more than 300s" in cond.message
    assert [e[1] for e in plan.events] == ["PodsStuck"]
    job = job.status(**plan.status.model_dump(by_alias=True, mode="json"))
    again = decide_on(job, [pods(1)[0], unschedulable(1, 405)])
    assert not again.events, "announced once"
    cleared = decide_on(job, pods(2))
    assert next(c for c in cleared.status.conditions if c.type == "PodsStuck").status == "False"


def test_pod_view_reads_why_a_pod_is_stuck():
    unsched = {"metadata": {"name": "j-0", "labels": {}}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/4 nodes",
         "lastTransitionTime": "2026-01-01T11:00:00Z"}]}}  # fmt: skip
    view = PodView.from_pod(unsched)
    assert (view.stuck, view.stuck_since) == ("Unschedulable: 0/4 nodes", "2026-01-01T11:00:00Z")
    waiting = {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}}
    pull = {"metadata": {"name": "j-0", "labels": {}}, "status": {
        "phase": "Pending", "startTime": "2026-01-01T11:00:00Z",
        "containerStatuses": [{"name": "trainer", "state": waiting}]}}  # fmt: skip
    assert PodView.from_pod(pull).stuck == "ImagePullBackOff: Back-off pulling image"


def test_an_incompatible_checkpoint_ends_the_job_at_once_by_default():
    incompatible = PodView(name="j-1", index=1, attempt=1, phase="Failed", node="node-1", exit_code=4)
    plan = decide_on(running(), [pods(1)[0], incompatible])
    assert plan.status.phase == "Failed" and plan.status.restarts == 0
    assert next(c for c in plan.status.conditions if c.type == "Failed").reason == "PermanentFailure"
