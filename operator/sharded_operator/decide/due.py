"""When a job must be looked at again with nothing changed: the clock-driven rules of the lifecycle."""

from __future__ import annotations

import datetime as dt

from sharded_api.contract import iso, parse_iso
from sharded_operator.api.models import ShardedTrainingJob
from sharded_operator.api.status import FINISHED, Phase, PodPhase, ShardedTrainingJobStatus
from sharded_operator.decide.failure import (
    MISSING_GRACE_SECONDS,
    latest,
    recovery_of,
    running_condition_since,
)
from sharded_operator.decide.views import Observed

# A timer fires this much after a threshold: the rules compare with > as well as >=.
DUE_MARGIN = dt.timedelta(milliseconds=50)


def next_due(job: ShardedTrainingJob, status: ShardedTrainingJobStatus, obs: Observed, now: dt.datetime
             ) -> dt.datetime | None:  # fmt: skip
    """The earliest time after `now` at which a rule of `decide` that depends on the clock could decide
    otherwise for this job as observed (`status` is the one just decided): a deadline, a hang or startup
    timeout, an in-place recovery's limit, a missing pod's grace, a node not Ready for nodeLostSeconds, a
    pod stuck past its grace on such a node, a pod unschedulable for schedulingTimeoutSeconds, the TTL.
    None: only an event (a job, pod or node change) can change the decision. Thresholds already passed
    were acted on by the decision that computed `status`."""
    spec, fp = job.spec, job.spec.failure_policy
    times: list[dt.datetime | None] = []

    def after(start: str | None, seconds: float | None) -> None:
        if seconds is not None and (t := parse_iso(start)) is not None:
            times.append(t + dt.timedelta(seconds=seconds))

    if status.phase in FINISHED:
        after(status.completion_time, spec.run_policy.ttl_seconds_after_finished)
    elif not spec.run_policy.suspend:
        after(status.active_since or status.start_time, spec.run_policy.active_deadline_seconds)
        if status.phase == Phase.RUNNING:
            progress = status.progress
            if progress and progress.attempt == status.attempt and progress.observed_at:
                after(iso(latest(progress.observed_at, obs.hearing_since)), fp.hang_timeout_seconds)
            elif running := running_condition_since(status):
                after(iso(latest(running, obs.hearing_since)), fp.startup_timeout_seconds)
        if (rec := recovery_of(status)) and rec.since:
            after(rec.since, fp.in_place_timeout_seconds)
        for since in obs.missing_since.values():
            after(since, MISSING_GRACE_SECONDS)
        for pod in obs.pods:
            if pod.stuck and pod.phase == PodPhase.PENDING and pod.attempt == status.attempt:
                after(pod.stuck_since, fp.scheduling_timeout_seconds)
    # Lost nodes matter in every phase: a finished job's pods stuck on one are forced out too.
    pods = [*obs.pods, *([obs.store] if obs.store else [])]
    for name in {p.node for p in pods if p.node} if obs.nodes is not None else ():
        view = obs.nodes.get(name)
        if view is None or not view.ready:  # a deleted node is lost at once; one not Ready, after a while
            if view is not None:
                after(view.since, fp.node_lost_seconds)
            times += [parse_iso(p.grace_ends) for p in pods if p.node == name and p.deleting]
    future = [t for t in times if t is not None and t > now]
    return min(future) + DUE_MARGIN if future else None
