"""Pure decisions: (job, observed pods and nodes, now) -> the next status and the actions to take.

Reconcile is level-based: every call looks at the whole world and says what should happen next, so
calling it twice, or after an operator restart, changes nothing that is already right.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from sharded_operator.builders import CONTAINER, pod_name
from sharded_operator.models import (
    FINISHED,
    LABEL_ATTEMPT,
    LABEL_INDEX,
    CheckpointStatus,
    Condition,
    ConditionType,
    FailureInfo,
    Phase,
    Progress,
    ShardedTrainingJob,
    ShardedTrainingJobStatus,
    TrainerEventCursor,
)
from sharded_trainer.contract import ProgressReport, TrainerEventType, iso, parse_iso

# Kubernetes pod phases (the pod's, not the job's).
POD_FINISHED = ("Succeeded", "Failed")
# How each trainer event shows among the job's Kubernetes events.
_EVENT_TYPES = {
    TrainerEventType.CHECKPOINT_SET_ASIDE: "Warning",
    TrainerEventType.INCOMPATIBLE_CHECKPOINT: "Warning",
}


@dataclass(frozen=True)
class PodView:
    """What reconcile needs to know about one pod."""

    name: str
    index: int
    attempt: int
    phase: str
    node: str | None = None
    deleting: bool = False
    ready: bool = False
    exit_code: int | None = None
    reason: str | None = None
    message: str = ""

    @classmethod
    def from_pod(cls, pod: dict[str, Any]) -> PodView:
        meta, status = pod["metadata"], pod.get("status") or {}
        term = None
        for cs in status.get("containerStatuses") or []:
            if cs.get("name") == CONTAINER or term is None:
                term = (cs.get("state") or {}).get("terminated") or term
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        labels = meta.get("labels") or {}
        return cls(
            name=meta["name"],
            index=int(labels.get(LABEL_INDEX, -1)),
            attempt=int(labels.get(LABEL_ATTEMPT, 0)),
            phase=status.get("phase") or "Pending",
            node=(pod.get("spec") or {}).get("nodeName"),
            deleting=bool(meta.get("deletionTimestamp")),
            ready=ready,
            exit_code=term.get("exitCode") if term else None,
            reason=(term or {}).get("reason") or status.get("reason"),
            message=(term or {}).get("message") or status.get("message") or "",
        )


@dataclass(frozen=True)
class Observed:
    pods: list[PodView]
    nodes: set[str] | None = None  # names of existing nodes; None if not known
    progress: ProgressReport | None = None  # latest report of rank 0


@dataclass
class Plan:
    """What reconcile decided: the status to write and the actions to take, in this order."""

    status: ShardedTrainingJobStatus
    create: list[int] = field(default_factory=list)  # node indices of the current attempt
    delete: list[str] = field(default_factory=list)  # pod names
    grace_seconds: int | None = None
    delete_job: bool = False
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)


def set_condition(
    status: ShardedTrainingJobStatus, type_: ConditionType, value: bool, reason: str, message: str, now: str
) -> None:
    """Upsert a condition; lastTransitionTime moves only when the status flips."""
    new = "True" if value else "False"
    for i, c in enumerate(status.conditions):
        if c.type == type_:
            changed = c.status != new
            status.conditions[i] = Condition(
                type=type_, status=new, reason=reason, message=message,
                last_transition_time=now if changed else c.last_transition_time,
            )  # fmt: skip
            return
    status.conditions.append(
        Condition(type=type_, status=new, reason=reason, message=message, last_transition_time=now)
    )


def set_ready(status: ShardedTrainingJobStatus, running: int, nodes: int) -> None:
    status.ready_nodes, status.ready = running, f"{running}/{nodes}"


def set_phase(status: ShardedTrainingJobStatus, phase: Phase, reason: str, message: str, now: str) -> None:
    """The phase, and the condition of each phase that has one: True for this phase, False for the rest."""
    status.phase = phase
    status.message = message
    for cond in ConditionType:
        if cond != ConditionType.CREATED:
            on = cond.value == phase.value
            set_condition(status, cond, on, reason if on else "", message if on else "", now)


# --- failure policy -----------------------------------------------------------------------------


def classify(job: ShardedTrainingJob, failure: FailureInfo) -> bool:
    """True if the failure is retryable (restart the gang), False if it is permanent."""
    fp = job.spec.failure_policy
    if failure.exit_code is None:  # evicted, deleted, node lost, hang: the infrastructure, not the code
        return True
    if failure.exit_code in fp.permanent_exit_codes:
        return False
    if fp.retryable_exit_codes is not None:
        return failure.exit_code in fp.retryable_exit_codes
    return True


def find_failure(job: ShardedTrainingJob, status: ShardedTrainingJobStatus, obs: Observed, now: str):
    """The first sign that the current attempt is broken, or None."""
    current = [p for p in obs.pods if p.attempt == status.attempt]
    for p in sorted(current, key=lambda p: p.index):
        if p.phase == "Failed":
            reason = p.reason or "Error"
            msg = p.message or f"trainer container exited with code {p.exit_code}"
            return FailureInfo(
                pod=p.name, node=p.node, node_rank=p.index, exit_code=p.exit_code, reason=reason,
                message=msg, attempt=status.attempt, time=now,
            )  # fmt: skip
        if obs.nodes is not None and p.node and p.node not in obs.nodes and p.phase not in POD_FINISHED:
            return FailureInfo(
                pod=p.name, node=p.node, node_rank=p.index, reason="NodeLost",
                message=f"node {p.node} no longer exists", attempt=status.attempt, time=now,
            )  # fmt: skip
        if p.deleting and p.phase not in POD_FINISHED:
            return FailureInfo(
                pod=p.name, node=p.node, node_rank=p.index, reason="PodDeleted",
                message="pod is being deleted (eviction, preemption or a user)", attempt=status.attempt, time=now,
            )  # fmt: skip
    if status.phase in (Phase.STARTING, Phase.RUNNING):
        present = {p.index for p in current}
        missing = sorted(set(range(job.spec.nodes)) - present)
        if missing:
            name = pod_name(job, missing[0])
            return FailureInfo(
                pod=name, node_rank=missing[0], reason="PodDeleted", message=f"pod {name} disappeared",
                attempt=status.attempt, time=now,
            )  # fmt: skip
    return None


def hang(job: ShardedTrainingJob, status: ShardedTrainingJobStatus, now: dt.datetime) -> FailureInfo | None:
    timeout = job.spec.failure_policy.hang_timeout_seconds
    if not timeout or status.phase != Phase.RUNNING:
        return None
    last = parse_iso(status.progress.updated_at if status.progress else None) or parse_iso(
        next((c.last_transition_time for c in status.conditions if c.type == ConditionType.RUNNING), None)
    )
    if last and (now - last).total_seconds() > timeout:
        return FailureInfo(
            reason="Hang", message=f"no training progress for more than {timeout}s", attempt=status.attempt,
            time=iso(now),
        )  # fmt: skip
    return None


# --- the decision -------------------------------------------------------------------------------


def decide(job: ShardedTrainingJob, obs: Observed, now: dt.datetime, grace: dict[str, int]) -> Plan:
    """`grace` has the settings' `restart` and `suspend` grace periods in seconds."""
    status = job.status.model_copy(deep=True)
    ts = iso(now)
    spec = job.spec
    status.observed_generation = job.metadata.get("generation")
    plan = Plan(status=status)

    if status.phase in FINISHED:
        return _finished(job, plan, obs, now)

    if status.attempt == 0:  # first sight of the job
        status.attempt = 1
        status.start_time = status.start_time or ts
        set_phase(status, Phase.PENDING, "Created", "creating pods", ts)
        set_condition(status, ConditionType.CREATED, True, "Created", "job accepted", ts)
    current = [p for p in obs.pods if p.attempt == status.attempt]
    stale = [p for p in obs.pods if p.attempt != status.attempt]

    _merge_report(plan, obs.progress)

    if spec.run_policy.suspend:
        plan.delete = [p.name for p in obs.pods if not p.deleting]
        plan.grace_seconds = grace["suspend"]
        if status.phase != Phase.SUSPENDED:
            plan.events.append(("Normal", "Suspended", "deleting pods; the trainer checkpoints on SIGTERM"))
        set_phase(status, Phase.SUSPENDED, "Suspended", "suspended: pods deleted, resume by setting suspend false", ts)
        set_ready(status, 0, spec.nodes)
        return plan
    if status.phase == Phase.SUSPENDED:  # resumed: a fresh attempt with a fresh rendezvous
        status.attempt += 1
        set_phase(status, Phase.PENDING, "Resumed", "resuming from the newest checkpoint", ts)
        plan.events.append(("Normal", "Resumed", f"starting attempt {status.attempt}"))
        current, stale = [], list(obs.pods)

    deadline = spec.run_policy.active_deadline_seconds
    started = parse_iso(status.start_time)
    if deadline and started and (now - started).total_seconds() > deadline:
        return _fail(job, plan, obs, "DeadlineExceeded", f"active for more than {deadline}s", now)

    failure = find_failure(job, status, obs, ts) or hang(job, status, now)
    if failure:
        return _restart_or_fail(job, plan, obs, failure, grace["restart"], now)

    # Old attempts must be gone before the new one starts: pod names are reused.
    plan.delete = [p.name for p in stale if not p.deleting]
    plan.grace_seconds = grace["restart"]
    if stale:
        set_phase(status, status.phase or Phase.PENDING, "WaitingForOldPods", "waiting for the previous pods to go", ts)
        return plan

    if current and all(p.phase == "Succeeded" for p in current) and len(current) == spec.nodes:
        status.completion_time = ts
        set_ready(status, 0, spec.nodes)
        set_phase(status, Phase.SUCCEEDED, "Completed", f"all {spec.nodes} nodes finished", ts)
        plan.events.append(("Normal", "Succeeded", f"training finished after {status.restarts} restarts"))
        return plan

    present = {p.index for p in current}
    plan.create = [i for i in range(spec.nodes) if i not in present]
    running = [p for p in current if p.phase == "Running"]
    set_ready(status, len(running), spec.nodes)
    if plan.create and not current:
        plan.events.append(("Normal", "Creating", f"creating {spec.nodes} pods for attempt {status.attempt}"))
    if len(running) == spec.nodes:
        if status.phase != Phase.RUNNING:
            plan.events.append(("Normal", "Running", f"all {spec.nodes} nodes running (attempt {status.attempt})"))
        set_phase(status, Phase.RUNNING, "AllNodesRunning", f"attempt {status.attempt}: training", ts)
    else:
        set_phase(status, Phase.STARTING, "PodsStarting", f"{len(running)}/{spec.nodes} nodes running", ts)
    return plan


def _merge_report(plan: Plan, report: ProgressReport | None) -> None:
    """Rank 0's latest report of the current attempt: its progress, and its events not reported yet."""
    status = plan.status
    if report is None or report.attempt != status.attempt:
        return
    status.progress = Progress(
        step=report.step, total_steps=report.total_steps, loss=report.loss, tokens_per_second=report.tokens_per_second,
        mfu=report.mfu, updated_at=report.updated_at,
    )  # fmt: skip
    if report.last_checkpoint:
        status.last_checkpoint = CheckpointStatus.model_validate(report.last_checkpoint.model_dump())
    cursor = status.last_trainer_event
    seen = cursor.seq if cursor and (cursor.attempt, cursor.run) == (report.attempt, report.run) else 0
    new = [e for e in report.events if e.seq > seen]
    for e in new:
        plan.events.append((_EVENT_TYPES.get(e.type, "Normal"), e.type.value, e.message))
    if new:
        status.last_trainer_event = TrainerEventCursor(attempt=report.attempt, run=report.run, seq=new[-1].seq)


def _restart_or_fail(job, plan: Plan, obs: Observed, failure: FailureInfo, grace: int, now: dt.datetime) -> Plan:
    status = plan.status
    status.last_failure = failure
    where = f"pod {failure.pod} (node rank {failure.node_rank}, node {failure.node})" if failure.pod else "the gang"
    detail = f"{failure.reason}: {where}" + (
        f" exited with {failure.exit_code}" if failure.exit_code is not None else ""
    )
    if not classify(job, failure):
        return _fail(job, plan, obs, "PermanentFailure", f"{detail}; exit code is permanent", now)
    if status.restarts >= job.spec.failure_policy.backoff_limit:
        limit = job.spec.failure_policy.backoff_limit
        return _fail(job, plan, obs, "BackoffLimitExceeded", f"{detail}; {limit} restarts used", now)
    status.restarts += 1
    status.attempt += 1
    plan.delete = [p.name for p in obs.pods if not p.deleting]
    plan.grace_seconds = grace
    set_ready(status, 0, job.spec.nodes)
    set_phase(
        status, Phase.RESTARTING, failure.reason, f"{detail}; restarting the gang as attempt {status.attempt}", iso(now)
    )
    plan.events.append(
        ("Warning", "Restarting", f"{detail}; restart {status.restarts}/{job.spec.failure_policy.backoff_limit}")
    )
    return plan


def _fail(job, plan: Plan, obs: Observed, reason: str, message: str, now: dt.datetime) -> Plan:
    status = plan.status
    status.completion_time = iso(now)
    set_ready(status, 0, job.spec.nodes)
    set_phase(status, Phase.FAILED, reason, message, iso(now))
    plan.events.append(("Warning", reason, message))
    return _finished(job, plan, obs, now)


def _finished(job: ShardedTrainingJob, plan: Plan, obs: Observed, now: dt.datetime) -> Plan:
    """cleanPodPolicy once the job has ended, then the TTL."""
    policy = job.spec.run_policy.clean_pod_policy
    if policy == "All":
        plan.delete = [p.name for p in obs.pods if not p.deleting]
    elif policy == "Running":
        plan.delete = [p.name for p in obs.pods if not p.deleting and p.phase not in POD_FINISHED]
    ttl = job.spec.run_policy.ttl_seconds_after_finished
    done = parse_iso(plan.status.completion_time)
    if ttl is not None and done and (now - done).total_seconds() >= ttl:
        plan.delete_job = True
    return plan
