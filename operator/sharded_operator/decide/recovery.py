"""In-place recovery, pure: a failed pod replaced alone while the others wait for it at the next rendezvous
round, and the recovery followed until training resumes."""

from __future__ import annotations

import datetime as dt

from sharded_api.contract import iso, parse_iso
from sharded_operator.api.models import ShardedTrainingJob
from sharded_operator.api.reasons import EventType, Reason
from sharded_operator.api.status import FailureInfo, InPlaceRecovery
from sharded_operator.decide.failure import in_place_budget, recovery_of
from sharded_operator.decide.plan import Plan
from sharded_operator.decide.views import Observed


def follow_recovery(plan: Plan, obs: Observed, now: dt.datetime, *, elastic: bool = False) -> None:
    """Keep the in-place recovery in step with what is observed: replacements seen are no longer pending,
    retired pods gone are forgotten, and a report from a new trainer process once nothing is pending means
    training resumed (with elastic, while replacements are pending too: the survivors train on)."""
    status = plan.status
    rec = recovery_of(status)
    if rec is None:
        status.recovery = None
        return
    listed = {p.uid for p in obs.pods}
    rec.retired = [u for u in rec.retired if u in listed]
    # The decision to replace a pod is written before its delete: a replica that died in between left a
    # retired pod that nothing else would remove, and its replacement (same name) waiting for it forever.
    plan.delete += [p.name for p in obs.pods if p.uid in rec.retired and not p.deleting and p.name not in plan.delete]
    replaced = {p.index for p in obs.pods if p.attempt == status.attempt and p.uid not in rec.retired}
    rec.pending = [i for i in rec.pending if i not in replaced]
    progress = status.progress
    since = parse_iso(rec.since)
    observed = parse_iso(progress.observed_at) if progress else None
    if (
        since and (elastic or not rec.pending) and progress and progress.attempt == status.attempt
        and progress.run not in (None, rec.run) and observed and observed >= since
    ):  # fmt: skip
        what = rec.last.pod if rec.last else "a pod"
        took = (observed - since).total_seconds()
        message = f"training resumed {took:.0f}s after {what} was replaced alone (step {progress.step})"
        plan.events.append((EventType.NORMAL, Reason.RECOVERED_IN_PLACE, message))
        rec.since = None


def replace_alone(
    job: ShardedTrainingJob,
    plan: Plan,
    obs: Observed,
    failures: list[FailureInfo],
    failure: FailureInfo,
    now: dt.datetime,
) -> None:
    """Replace the failed pods alone: delete each (its name is reused) and create it again once it is gone;
    the surviving agents restart their workers and wait for it at the next rendezvous round."""
    status = plan.status
    rec = recovery_of(status) or InPlaceRecovery(attempt=status.attempt)
    pods = {p.name: p for p in obs.pods if p.attempt == status.attempt}
    for f in sorted(failures, key=lambda f: f.node_rank or 0):
        pod = pods.get(f.pod or "")
        if pod is not None and pod.uid:
            rec.retired.append(pod.uid)
        if pod is not None and not pod.deleting:
            plan.delete.append(pod.name)
        if f.node_rank not in rec.pending:
            rec.pending.append(f.node_rank)  # type: ignore[arg-type] # replaceable() checked it is set
        rec.replacements += 1
        status.pod_replacements += 1
    progress = status.progress
    if rec.since is None:
        rec.run = progress.run if progress and progress.attempt == status.attempt else None
    rec.since = iso(now)
    rec.last = failure
    status.recovery = rec
    names = ", ".join(f.pod or "" for f in failures)
    exited = f" exited with {failure.exit_code}" if failure.exit_code is not None else ""
    detail = f"{failure.reason}: {names}{exited}"
    message = (
        f"{detail}; replacing it alone ({rec.replacements}/{in_place_budget(job)} in attempt {status.attempt}); "
        "the other nodes wait for it at the next rendezvous round"
    )
    plan.events.append((EventType.WARNING, Reason.REPLACING_POD, message))
