"""In-place recovery decisions: a failed pod replaced alone while the others wait at the next rendezvous round,
bounded by a budget and a deadline, and the rendezvous store pod that lets any training pod die."""

from __future__ import annotations

import datetime as dt

import pytest

from sharded_api.contract import iso
from sharded_operator.api.models import ShardedTrainingJob
from sharded_operator.api.status import Progress
from sharded_operator.decide.lifecycle import decide
from sharded_operator.decide.plan import Plan
from sharded_operator.decide.views import NodeView, Observed, PodView
from support.jobs import make_job

NOW = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)
GRACE = {"restart": 30, "suspend": 120}
STORE = PodView(name="j-rdzv", index=-1, attempt=0, phase="Running", node="node-9", uid="store-1")


def gang(n: int = 3, attempt: int = 1, phase: str = "Running", **overrides) -> list[PodView]:
    return [
        PodView(name=f"j-{i}", index=i, attempt=attempt, phase=phase, node=f"node-{i}", uid=f"uid-{i}-a", **overrides)
        for i in range(n)
    ]  # fmt: skip


def job(in_place: int = 2, nodes: int = 3, **status) -> ShardedTrainingJob:
    fields = {"attempt": 1, "phase": "Running", "startTime": iso(NOW), **status}
    return make_job().nodes(nodes).spec("failurePolicy.inPlaceRestarts", in_place).status(**fields).model()


def seen(pods: list[PodView], store: PodView | None = STORE, **kw) -> Observed:
    nodes = {f"node-{i}": NodeView() for i in range(10)}
    return Observed(pods=pods, nodes=nodes, store=store, store_listed=True, **kw)


def then(j: ShardedTrainingJob, plan: Plan) -> ShardedTrainingJob:
    """The job as the next reconcile reads it: with the status this plan wrote."""
    return j.model_copy(update={"status": plan.status})


def failed(pod: PodView, exit_code: int = 1) -> PodView:
    return PodView(name=pod.name, index=pod.index, attempt=pod.attempt, phase="Failed", node=pod.node, uid=pod.uid,
                   exit_code=exit_code, reason="Error")  # fmt: skip


def running_reason(plan: Plan) -> str:
    return next(c.reason for c in plan.status.conditions if c.type == "Running")


def reasons(plan: Plan) -> list[str]:
    return [reason for _, reason, _ in plan.events]


def test_a_failed_pod_is_replaced_alone_and_training_resumes_without_a_new_attempt():
    j = job(progress={"step": 20, "attempt": 1, "run": "run-a", "observedAt": iso(NOW)})
    pods = gang()
    pods[1] = failed(pods[1])
    plan = decide(j, seen(pods), NOW, GRACE)
    s = plan.status
    assert s.attempt == 1 and s.restarts == 0 and s.pod_replacements == 1 and s.last_failure is None
    assert plan.delete == ["j-1"] and plan.create == [] and not plan.create_store  # its name is reused: gone first
    assert s.recovery.pending == [1] and s.recovery.retired == ["uid-1-a"] and s.recovery.run == "run-a"
    assert s.phase == "Running" and running_reason(plan) == "RecoveringInPlace" and s.ready == "2/3"
    assert "ReplacingPod" in reasons(plan) and s.recovery.last.pod == "j-1" and s.recovery.last.exit_code == 1

    # still terminating: its failure is handled, nothing more to do; gone: created again, no failure for it
    j = then(j, plan)
    later = NOW + dt.timedelta(seconds=3)
    plan = decide(j, seen([pods[0], PodView(**{**vars(pods[1]), "deleting": True}), pods[2]]), later, GRACE)
    assert plan.create == [] and plan.delete == [] and plan.status.attempt == 1 and plan.events == []
    j = then(j, plan)
    plan = decide(j, seen([pods[0], pods[2]], missing_since={"j-1": iso(NOW)}), later, GRACE)
    assert plan.create == [1] and plan.status.attempt == 1 and plan.status.recovery.retired == []

    # the replacement is listed (a new UID): no longer pending; a report of the old process closes nothing
    j = then(j, plan)
    replacement = PodView(name="j-1", index=1, attempt=1, phase="Running", node="node-5", uid="uid-1-b")
    plan = decide(j, seen([pods[0], replacement, pods[2]]), later, GRACE)
    assert plan.create == [] and plan.status.recovery.pending == [] and plan.status.recovery.since is not None

    # a report from a new trainer process after the replacement: training resumed in place
    progress = Progress(step=10, attempt=1, run="run-b", observed_at=iso(later + dt.timedelta(seconds=9)))
    j = then(j, plan).model_copy(deep=True)
    j.status.progress = progress
    plan = decide(j, seen([pods[0], replacement, pods[2]]), later + dt.timedelta(seconds=10), GRACE)
    assert plan.status.recovery.since is None and "RecoveredInPlace" in reasons(plan)
    assert plan.status.phase == "Running" and running_reason(plan) == "AllNodesRunning"
    assert plan.status.attempt == 1 and plan.status.pod_replacements == 1


def test_a_replacement_decided_by_a_replica_that_died_before_its_delete_is_carried_out_by_the_next():
    """The status says j-1 is retired and its replacement pending, but j-1 is still there, not deleting (the
    replica that wrote the decision was killed before the delete): the next reconcile deletes it, and only
    then is j-1 created again; no failure is counted twice."""
    j = job()
    pods = gang()
    pods[1] = failed(pods[1])
    written = then(j, decide(j, seen(pods), NOW, GRACE))
    assert written.status.recovery.retired == ["uid-1-a"] and written.status.recovery.pending == [1]
    later = NOW + dt.timedelta(seconds=5)
    plan = decide(written, seen(pods), later, GRACE)
    assert plan.delete == ["j-1"] and plan.create == []
    assert plan.status.pod_replacements == 1 and plan.status.restarts == 0 and "ReplacingPod" not in reasons(plan)
    deleting = [pods[0], PodView(**{**vars(pods[1]), "deleting": True}), pods[2]]
    assert decide(then(written, plan), seen(deleting), later, GRACE).delete == []


@pytest.mark.parametrize("index", [0, 2])
def test_any_pod_may_be_the_lost_one_node_zero_too(index):
    """No training pod hosts the rendezvous: pod 0 is replaced like any other."""
    pods = gang()
    pods[index] = PodView(**{**vars(pods[index]), "deleting": True})  # deleted by someone
    plan = decide(job(), seen(pods), NOW, GRACE)
    assert plan.status.attempt == 1 and plan.status.recovery.pending == [index] and plan.delete == []
    assert plan.status.recovery.last.reason == "PodDeleted"


def test_a_pod_on_a_lost_node_is_replaced_alone():
    pods = gang()
    observed = seen(pods)
    del observed.nodes["node-2"]
    plan = decide(job(), observed, NOW, GRACE)
    assert plan.status.attempt == 1 and plan.delete == ["j-2"] and plan.status.recovery.last.reason == "NodeLost"


@pytest.mark.parametrize(
    "case,expected",
    [
        ("no-in-place-restarts", "Restarting"),
        ("budget-used", "Restarting"),
        ("every-pod-failed", "Restarting"),
        ("permanent-exit-code", "Failed"),
    ],
)
def test_when_a_pod_is_not_replaced_alone(case, expected):
    j = job(in_place=0 if case == "no-in-place-restarts" else 2)
    if case == "budget-used":
        j = job(recovery={"attempt": 1, "replacements": 2})
    pods = gang()
    pods[1] = failed(pods[1], exit_code=2 if case == "permanent-exit-code" else 1)
    if case == "every-pod-failed":
        pods = [failed(p) for p in pods]
    plan = decide(j, seen(pods), NOW, GRACE)
    assert plan.status.phase == expected and plan.status.pod_replacements == 0
    if expected == "Restarting":
        assert plan.status.attempt == 2 and plan.status.recovery is None
        assert sorted(plan.delete) == ["j-0", "j-1", "j-2"]


def test_the_replacement_failing_again_is_replaced_again_within_the_budget_then_the_gang_restarts():
    pods = gang()
    pods[1] = failed(pods[1])
    j = then(job(), decide(job(), seen(pods), NOW, GRACE))
    again = failed(PodView(name="j-1", index=1, attempt=1, phase="Running", node="node-5", uid="uid-1-b"))
    plan = decide(j, seen([pods[0], again, pods[2]]), NOW, GRACE)
    assert plan.status.attempt == 1 and plan.status.recovery.replacements == 2 and plan.delete == ["j-1"]
    assert plan.status.recovery.retired == ["uid-1-b"]  # the first one is gone: forgotten
    j = then(j, plan)
    third = failed(PodView(name="j-1", index=1, attempt=1, phase="Running", node="node-6", uid="uid-1-c"))
    plan = decide(j, seen([pods[0], third, pods[2]]), NOW, GRACE)
    assert plan.status.attempt == 2 and plan.status.restarts == 1 and plan.status.last_failure.pod == "j-1"


def test_training_that_does_not_resume_in_time_restarts_the_gang():
    pods = gang()
    pods[1] = failed(pods[1])
    j = then(job(), decide(job(), seen(pods), NOW, GRACE))
    limit = j.spec.failure_policy.in_place_timeout_seconds
    replacement = PodView(name="j-1", index=1, attempt=1, phase="Pending", uid="uid-1-b", stuck="Unschedulable: x")
    observed = seen([pods[0], replacement, pods[2]])
    assert decide(j, observed, NOW + dt.timedelta(seconds=limit - 1), GRACE).status.attempt == 1
    plan = decide(j, observed, NOW + dt.timedelta(seconds=limit + 1), GRACE)
    assert plan.status.attempt == 2 and plan.status.last_failure.reason == "InPlaceRecoveryTimeout"
    assert plan.status.restarts == 1 and "inPlaceTimeoutSeconds" in plan.status.last_failure.message


def test_a_hang_is_the_gangs_failure_never_one_pods():
    old = iso(NOW - dt.timedelta(seconds=700))
    j = job(progress={"step": 5, "attempt": 1, "run": "r", "observedAt": old})
    j = j.model_copy(deep=True)
    j.spec.failure_policy.hang_timeout_seconds = 600
    plan = decide(j, seen(gang()), NOW, GRACE)
    assert plan.status.attempt == 2 and plan.status.last_failure.reason == "Hang"


@pytest.mark.parametrize(
    "store,running,verdict",
    [
        (None, False, "create"),  # not made yet, or gone before any agent used it: made (again)
        (None, True, "RendezvousLost"),
        (PodView(**{**vars(STORE), "phase": "Failed", "exit_code": 137}), True, "RendezvousLost"),
        (PodView(**{**vars(STORE), "deleting": True}), True, "RendezvousLost"),
        (PodView(**{**vars(STORE), "node": "gone"}), True, "RendezvousLost"),
        (STORE, True, "fine"),
        (PodView(**{**vars(STORE), "phase": "Failed", "exit_code": 1}), False, "wait"),
        (PodView(**{**vars(STORE), "node": "gone"}), False, "wait"),
    ],
    ids=[
        "absent-before-start",
        "vanished",
        "failed",
        "deleted",
        "node-lost",
        "running",
        "failed-before-start",
        "node-lost-before-start",
    ],
)
def test_the_rendezvous_store_pod(store, running, verdict):
    pods = gang(phase="Running" if running else "Pending")
    plan = decide(job(), seen(pods, store=store), NOW, GRACE)
    if verdict == "RendezvousLost":
        # a disruption (the infrastructure's): a new attempt not counted against backoffLimit, and a new store
        assert plan.status.attempt == 2 and plan.status.last_failure.reason == "RendezvousLost"
        assert plan.status.restarts == 0 and plan.status.disruptions == 1
        assert plan.delete_store == (store is not None and (not store.deleting or store.node == "gone"))
        assert plan.store_grace == (0 if store is not None and store.node == "gone" else None)
    elif verdict == "wait":
        # no pod may join through a store about to go: it goes (without grace on a lost node), they wait
        assert plan.status.attempt == 1 and plan.delete_store and plan.create == [] and not plan.create_store
        assert plan.store_grace == (0 if store.node == "gone" else None)
        assert running_reason(plan) != "AllNodesRunning" and "rendezvous store" in plan.status.message
    else:
        assert plan.status.attempt == 1 and plan.create_store == (verdict == "create") and not plan.delete_store


def test_the_store_pod_goes_when_the_job_is_suspended_or_finished_and_is_made_again_on_resume():
    suspended = job().model_copy(deep=True)
    suspended.spec.run_policy.suspend = True
    assert decide(suspended, seen(gang()), NOW, GRACE).delete_store
    finished = seen(gang(phase="Succeeded"))
    done = decide(job(), finished, NOW, GRACE)
    assert done.status.phase == "Succeeded"
    assert decide(then(job(), done), finished, NOW, GRACE).delete_store
    resumed = decide(job(phase="Suspended"), seen([], store=None), NOW, GRACE)
    assert resumed.create == [0, 1, 2] and resumed.create_store


def test_a_recovery_of_an_earlier_attempt_is_void():
    j = job(attempt=2, recovery={"attempt": 1, "replacements": 2, "pending": [1], "retired": ["uid-1-a"]})
    plan = decide(j, seen(gang(attempt=2)), NOW, GRACE)
    assert plan.status.recovery is None and plan.create == []


def elastic(nodes: int = 3, **status) -> ShardedTrainingJob:
    fields = {"attempt": 1, "phase": "Running", "startTime": iso(NOW), "desiredNodes": 3, **status}
    spec = make_job().nodes(nodes).spec("elastic", {"minNodes": 2, "maxNodes": 3, "maxRestarts": 3})
    return spec.status(**fields).model()


def test_elastic_trains_on_with_the_survivors_while_the_replacement_waits_for_capacity():
    pods = gang()
    observed = seen(pods)
    del observed.nodes["node-2"]
    j = then(elastic(), decide(elastic(), observed, NOW, GRACE))
    assert j.status.recovery.pending == [2] and j.status.attempt == 1
    # gone; its replacement cannot schedule; the two survivors rendezvous without it and report
    replacement = PodView(name="j-2", index=2, attempt=1, phase="Pending", uid="uid-2-b", stuck="Unschedulable: 0/2")
    j = j.model_copy(deep=True)
    seen_at = iso(NOW + dt.timedelta(seconds=8))
    j.status.progress = Progress(step=12, attempt=1, run="run-b", nodes=2, observed_at=seen_at)
    later = NOW + dt.timedelta(seconds=9)
    plan = decide(j, seen([pods[0], pods[1], replacement]), later, GRACE)
    assert plan.status.recovery.since is None and "RecoveredInPlace" in reasons(plan)  # closed with it pending
    assert plan.status.current_nodes == 2 and plan.status.desired_nodes == 3 and plan.status.ready == "2/3"
    # much later, still no capacity: no timeout, no new attempt (it trains on two)
    j = then(j, plan)
    much_later = NOW + dt.timedelta(seconds=j.spec.failure_policy.in_place_timeout_seconds * 3)
    assert decide(j, seen([pods[0], pods[1], replacement]), much_later, GRACE).status.attempt == 1


def test_editing_nodes_resizes_an_elastic_job_in_place():
    down = decide(elastic(nodes=2), seen(gang()), NOW, GRACE)
    assert down.delete == ["j-2"] and down.create == [] and down.status.attempt == 1
    assert {"Resizing", "ScalingDown"} <= set(reasons(down)) and down.status.desired_nodes == 2
    going = [*gang()[:2], PodView(**{**vars(gang()[2]), "deleting": True})]
    after = decide(then(elastic(nodes=2), down), seen(going), NOW, GRACE)  # not a failure: it was asked to go
    assert after.status.attempt == 1 and after.status.recovery is None and after.delete == []
    up = decide(elastic(nodes=3, desiredNodes=2), seen(gang(2)), NOW, GRACE)
    assert up.create == [2] and up.status.attempt == 1 and "Resizing" in reasons(up)


def test_an_elastic_job_succeeds_once_min_nodes_finished():
    pods = [*gang(2, phase="Succeeded"), PodView(name="j-2", index=2, attempt=1, phase="Pending", uid="uid-2-b")]
    plan = decide(elastic(), seen(pods), NOW, GRACE)
    assert plan.status.phase == "Succeeded" and plan.delete == ["j-2"]  # it never joined: deleted, not judged
    one = decide(elastic(), seen([*gang(1, phase="Succeeded"), *gang(3)[1:]]), NOW, GRACE)
    assert one.status.phase != "Succeeded"  # fewer than minNodes done: not yet


def test_a_node_lost_with_a_pod_and_the_store_on_it_restarts_the_gang_naming_the_node():
    """The pod alone cannot be replaced: every agent needs a new store. The failure named is the pod's."""
    pods = gang()
    observed = seen(pods, store=PodView(**{**vars(STORE), "node": "node-2"}))
    del observed.nodes["node-2"]
    plan = decide(job(), observed, NOW, GRACE)
    assert plan.status.attempt == 2 and plan.status.pod_replacements == 0 and plan.status.disruptions == 1
    assert plan.status.last_failure.reason == "NodeLost" and plan.status.last_failure.pod == "j-2"
    assert plan.delete_store and plan.store_grace == 0


@pytest.mark.parametrize(
    "path,value",
    [("rendezvous.lastCallSeconds", 0), ("rendezvous.lastCallSeconds", 601), ("rendezvous.lastCallSeconds", "x"),
     ("failurePolicy.inPlaceTimeoutSeconds", 9), ("failurePolicy.inPlaceTimeoutSeconds", 86401),
     ("failurePolicy.inPlaceRestarts", -1), ("failurePolicy.inPlaceRestarts", 101)],
)  # fmt: skip
def test_the_recovery_settings_are_bounded(path, value):
    with pytest.raises(ValueError, match=path.rsplit(".", 1)[1].replace("Seconds", "")):
        make_job().spec(path, value).model()
