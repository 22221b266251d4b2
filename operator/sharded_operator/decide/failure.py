"""Failure policy, pure: what broke the current attempt, whether it is permanent, a disruption, or a hang.

A disruption is the infrastructure taking pods away (an eviction or preemption the API server marks
with a DisruptionTarget condition, a lost node, or the trainer's exit 75 after it was asked to stop and
checkpointed). By default it restarts the gang without using `backoffLimit`, as Jobs and JobSet do.
Every time here is the operator's clock; the trainer's own timestamps are only shown.
"""

from __future__ import annotations

import datetime as dt

from sharded_api.contract import ExitCode, iso, parse_iso
from sharded_operator.api.models import ShardedTrainingJob
from sharded_operator.api.reasons import Reason
from sharded_operator.api.status import (
    ConditionType,
    FailureInfo,
    InPlaceRecovery,
    Phase,
    PodPhase,
    ShardedTrainingJobStatus,
)
from sharded_operator.decide.views import POD_FINISHED, Observed
from sharded_operator.render.names import pod_name

# Reasons of failures that are disruptions whatever their exit code.
DISRUPTION_REASONS = frozenset(
    {
        Reason.NODE_LOST,
        Reason.EVICTED,
        Reason.DISRUPTION_TARGET,
        Reason.PREEMPTED,
        Reason.RENDEZVOUS_LOST,
        Reason.POD_VANISHED,
    }
)
# Failures of the whole gang, never of one pod: no replacement of a pod alone recovers from them.
GANG_REASONS = frozenset(
    {Reason.HANG, Reason.STARTUP_TIMEOUT, Reason.RENDEZVOUS_LOST, Reason.IN_PLACE_RECOVERY_TIMEOUT}
)
# How long a vanished pod waits for its deletion event (which says why it went) before it counts anyway.
MISSING_GRACE_SECONDS = 5


def recovery_of(status: ShardedTrainingJobStatus) -> InPlaceRecovery | None:
    """The in-place recovery of the current attempt, if any (one of an earlier attempt is void)."""
    rec = status.recovery
    return rec if rec is not None and rec.attempt == status.attempt else None


def _missing_indices(job: ShardedTrainingJob, status: ShardedTrainingJobStatus, obs: Observed) -> list[int]:
    """Indices of the current attempt with no pod, but those whose replacement the operator has yet to create."""
    if status.phase not in (Phase.STARTING, Phase.RUNNING):
        return []
    present = {p.index for p in obs.pods if p.attempt == status.attempt}
    pending = set(rec.pending) if (rec := recovery_of(status)) else set()
    # Indices an elastic job just grew to have no pod yet: never made, not missing.
    had = min(job.spec.nodes, status.desired_nodes or job.spec.nodes)
    return [i for i in range(had) if i not in present and i not in pending]


def missing_pods(job: ShardedTrainingJob, status: ShardedTrainingJobStatus, obs: Observed) -> list[str]:
    """Pods the current attempt should have but the API server no longer lists."""
    return [pod_name(job, i) for i in _missing_indices(job, status, obs)]


def is_permanent(job: ShardedTrainingJob, failure: FailureInfo) -> bool:
    """An exit code the policy names permanent, or one outside an explicit retryable list."""
    fp = job.spec.failure_policy
    if failure.exit_code is None:  # evicted, deleted, node lost, hang: the infrastructure, not the code
        return False
    if failure.exit_code in fp.permanent_exit_codes:
        return True
    return fp.retryable_exit_codes is not None and failure.exit_code not in fp.retryable_exit_codes


def is_disruption(failure: FailureInfo) -> bool:
    return failure.reason in DISRUPTION_REASONS or failure.exit_code == ExitCode.PREEMPTED


def current_failures(
    job: ShardedTrainingJob, status: ShardedTrainingJobStatus, obs: Observed, now: dt.datetime
) -> list[FailureInfo]:
    """Every sign that the current attempt is broken, one per pod, each with the time it happened."""
    ts = iso(now)
    retired = set(rec.retired) if (rec := recovery_of(status)) else set()
    # A pod already replaced alone is going away on purpose: its failure has been handled; so is one beyond
    # spec.nodes (an elastic job resized down).
    current = [p for p in obs.pods if p.attempt == status.attempt and p.uid not in retired and p.index < job.spec.nodes]
    out = []
    for p in sorted(current, key=lambda p: p.index):
        where = {"pod": p.name, "node": p.node, "node_rank": p.index, "attempt": status.attempt}
        if p.phase == PodPhase.FAILED:
            reason = Reason.DISRUPTION_TARGET if p.disruption and p.exit_code != ExitCode.PREEMPTED else None
            out.append(FailureInfo(
                **where, exit_code=p.exit_code, reason=reason or p.reason or Reason.ERROR,
                message=p.message or p.disruption or f"trainer container exited with code {p.exit_code}",
                time=p.finished_at or ts,
            ))  # fmt: skip
        elif (lost := node_lost(job, obs, p.node, now)) and p.phase not in POD_FINISHED:
            out.append(FailureInfo(**where, reason=Reason.NODE_LOST, message=lost, time=ts))
        elif p.deleting and p.phase not in POD_FINISHED:
            if p.disruption:
                reason, message = Reason.DISRUPTION_TARGET, p.disruption
            else:
                reason, message = Reason.POD_DELETED, "pod is being deleted (by a user or a controller)"
            out.append(FailureInfo(**where, reason=reason, message=message, time=p.deleted_at or ts))
    for index in _missing_indices(job, status, obs):
        name = pod_name(job, index)
        last = obs.departed.get(name)
        ours = last is not None and last.owner_uid in (None, job.metadata.get("uid"))
        last = last if last and ours and last.attempt == status.attempt else None
        since = parse_iso(obs.missing_since.get(name))
        if last is None and (since is None or (now - since).total_seconds() < MISSING_GRACE_SECONDS):
            continue  # why it went is not known yet
        if last and last.disruption:
            reason, message = Reason.DISRUPTION_TARGET, last.disruption
        elif last is None and name in obs.unwatched:
            # An eviction, a preemption or a node's garbage collection while the operator was down looks
            # like this: the benefit of the doubt, as a disruption, rather than a restart the code is blamed for.
            reason, message = Reason.POD_VANISHED, (f"pod {name} went while the operator was not watching; why is not "
                                              f"known, so it counts as a disruption")  # fmt: skip
        else:
            reason, message = Reason.POD_DELETED, f"pod {name} disappeared"
        out.append(FailureInfo(
            pod=name, node=last.node if last else None, node_rank=index, reason=reason, message=message,
            attempt=status.attempt, time=ts,
        ))  # fmt: skip
    return out


def store_trouble(job: ShardedTrainingJob, obs: Observed, now: dt.datetime) -> str | None:
    """Why the rendezvous store pod cannot serve (it ended, is being deleted, or is on a lost node); None
    when it is fine or absent."""
    store = obs.store
    if store is None:
        return None
    if store.phase in POD_FINISHED:
        return f"the rendezvous store pod {store.name} ended ({store.phase}, exit code {store.exit_code})"
    if store.deleting:
        return f"the rendezvous store pod {store.name} is being deleted"
    if lost := node_lost(job, obs, store.node, now):
        return f"the rendezvous store pod {store.name}: {lost}"
    return None


def store_lost(
    job: ShardedTrainingJob, status: ShardedTrainingJobStatus, obs: Observed, now: dt.datetime
) -> FailureInfo | None:
    """The store pod is in trouble or vanished while pods of the attempt run: their agents may have joined
    through it, and every agent's next round (and its heartbeat) needs it. Before any pod runs, it is only
    made again (`decide`)."""
    if not obs.store_listed or status.phase not in (Phase.STARTING, Phase.RUNNING):
        return None
    if not any(p.attempt == status.attempt and p.phase == PodPhase.RUNNING for p in obs.pods):
        return None
    store = obs.store
    message = "the rendezvous store pod disappeared" if store is None else store_trouble(job, obs, now)
    if message is None:
        return None
    return FailureInfo(
        pod=store.name if store else None, node=store.node if store else None, reason=Reason.RENDEZVOUS_LOST,
        message=message, attempt=status.attempt, time=iso(now),
    )  # fmt: skip


def recovery_overdue(job: ShardedTrainingJob, status: ShardedTrainingJobStatus, now: dt.datetime) -> FailureInfo | None:
    """A pod replaced alone, and training has not resumed within failurePolicy.inPlaceTimeoutSeconds."""
    rec = recovery_of(status)
    since = parse_iso(rec.since) if rec else None
    limit = job.spec.failure_policy.in_place_timeout_seconds
    if rec is None or since is None or (now - since).total_seconds() <= limit:
        return None
    what = f"pod {rec.last.pod}" if rec.last and rec.last.pod else "a pod"
    message = f"training did not resume within {limit}s of replacing {what} alone (failurePolicy.inPlaceTimeoutSeconds)"
    return FailureInfo(reason=Reason.IN_PLACE_RECOVERY_TIMEOUT, message=message, attempt=status.attempt, time=iso(now))


def in_place_budget(job: ShardedTrainingJob) -> int:
    """Pods that may be replaced alone per attempt: every replacement costs each surviving agent a restart."""
    spec = job.spec
    return spec.elastic.max_restarts if spec.elastic else spec.failure_policy.in_place_restarts


def replaceable(
    job: ShardedTrainingJob, status: ShardedTrainingJobStatus, failures: list[FailureInfo], failure: FailureInfo
) -> bool:
    """Whether the pods in `failures` can be replaced alone while the others wait at the next rendezvous
    round: in-place restarts are on and not used up in this attempt, every failure is one pod's and none is
    permanent, and at least one node survives (with none, a gang restart is the same and simpler)."""
    if failure.reason in GANG_REASONS or not failures or any(f.pod is None or f.node_rank is None for f in failures):
        return False
    if any(is_permanent(job, f) for f in failures):
        return False
    rec = recovery_of(status)
    used = rec.replacements if rec else 0
    return used + len(failures) <= in_place_budget(job) and len({f.node_rank for f in failures}) < job.spec.nodes


def node_lost(job: ShardedTrainingJob, obs: Observed, node: str | None, now: dt.datetime) -> str | None:
    """Why `node` counts as lost (deleted, or not Ready for nodeLostSeconds), or None."""
    if obs.nodes is None or not node:
        return None
    view = obs.nodes.get(node)
    if view is None:
        return f"node {node} no longer exists"
    limit = job.spec.failure_policy.node_lost_seconds
    since = parse_iso(view.since)
    if not view.ready and since and (now - since).total_seconds() >= limit:
        return f"node {node} has not been Ready for {(now - since).total_seconds():.0f}s (nodeLostSeconds {limit})"
    return None


def stuck_on_lost_nodes(job: ShardedTrainingJob, obs: Observed, now: dt.datetime) -> list[str]:
    """Pods being deleted past their grace on a lost node: no kubelet will ever confirm them gone, and the
    next attempt reuses their names."""
    return [
        p.name for p in obs.pods
        if p.deleting and p.grace_ends and parse_iso(p.grace_ends) <= now and node_lost(job, obs, p.node, now)
    ]  # fmt: skip


def first_failure(job: ShardedTrainingJob, failures: list[FailureInfo]) -> FailureInfo | None:
    """The failure that ends the attempt: a permanent one anywhere wins; otherwise the first in time."""
    permanent = [f for f in failures if is_permanent(job, f)]
    candidates = permanent or failures
    return min(candidates, key=lambda f: (f.time or "", f.node_rank or 0), default=None)


def hang(
    job: ShardedTrainingJob, status: ShardedTrainingJobStatus, now: dt.datetime, hearing_since: str | None = None
) -> FailureInfo | None:
    """No new report of this attempt for `hangTimeoutSeconds`, or none at all `startupTimeoutSeconds`
    after every pod ran. An attempt that never reports (a custom script) is never declared hung. Both
    count from `hearing_since` at the earliest: a silence the operator could not have heard proves nothing."""
    fp = job.spec.failure_policy
    if status.phase != Phase.RUNNING:
        return None
    progress = status.progress
    if progress and progress.attempt == status.attempt and progress.observed_at:
        quiet = (now - latest(progress.observed_at, hearing_since)).total_seconds()
        if fp.hang_timeout_seconds and quiet > fp.hang_timeout_seconds:
            message = f"no new progress report for {quiet:.0f}s (hangTimeoutSeconds {fp.hang_timeout_seconds})"
            return FailureInfo(reason=Reason.HANG, message=message, attempt=status.attempt, time=iso(now))
        return None
    running_since = running_condition_since(status)
    if fp.startup_timeout_seconds and running_since:
        waited = (now - latest(running_since, hearing_since)).total_seconds()
        if waited > fp.startup_timeout_seconds:
            message = (
                f"no progress report {waited:.0f}s after every pod ran (startupTimeoutSeconds "
                f"{fp.startup_timeout_seconds})"
            )
            return FailureInfo(reason=Reason.STARTUP_TIMEOUT, message=message, attempt=status.attempt, time=iso(now))
    return None


def running_condition_since(status: ShardedTrainingJobStatus) -> str | None:
    """When every pod of the attempt was last seen running (the Running condition's transition)."""
    return next((c.last_transition_time for c in status.conditions
                 if c.type == ConditionType.RUNNING and c.status == "True"), None)  # fmt: skip


def latest(start: str, floor: str | None) -> dt.datetime:
    """`start`, or `floor` if that is later (both RFC 3339; `start` must parse)."""
    t, f = parse_iso(start), parse_iso(floor)
    assert t is not None
    return max(t, f) if f is not None else t
