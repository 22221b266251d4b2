"""Pure decisions: (job, observed pods and nodes, now) -> the next status and the actions to take.

Reconcile is level-based: every call looks at the whole world and says what should happen next, so
calling it twice, or after an operator restart, changes nothing that is already right.
"""

from __future__ import annotations

import datetime as dt

from sharded_api.contract import iso, parse_iso
from sharded_operator.api.models import ShardedTrainingJob
from sharded_operator.api.reasons import EventType, Reason
from sharded_operator.api.status import FINISHED, ConditionType, FailureInfo, Phase, PodPhase
from sharded_operator.decide.failure import (
    current_failures,
    first_failure,
    hang,
    is_disruption,
    is_permanent,
    missing_pods,
    node_lost,
    recovery_of,
    recovery_overdue,
    replaceable,
    store_lost,
    store_trouble,
    stuck_on_lost_nodes,
)
from sharded_operator.decide.plan import Plan, announce, set_condition, set_phase, set_ready
from sharded_operator.decide.recovery import follow_recovery, replace_alone
from sharded_operator.decide.views import POD_FINISHED, UNSCHEDULABLE, Observed, PodView

# --- the decision -------------------------------------------------------------------------------


def decide(job: ShardedTrainingJob, obs: Observed, now: dt.datetime, grace: dict[str, int]) -> Plan:
    """`grace` has the settings' `restart` and `suspend` grace periods in seconds."""
    status = job.status.model_copy(deep=True)
    ts = iso(now)
    spec = job.spec
    status.observed_generation = job.metadata.get("generation")
    plan = Plan(status=status)
    plan.force_delete = stuck_on_lost_nodes(job, obs, now)
    for pod in plan.force_delete:
        plan.events.append(
            (EventType.WARNING, Reason.FORCE_DELETED, f"pod {pod} is on a lost node: deleted without its grace")
        )

    if status.phase in FINISHED:
        return _finished(job, plan, obs, now)

    if status.attempt == 0:  # first sight of the job
        status.attempt = 1
        status.start_time = status.start_time or ts
        status.active_since = ts
        set_phase(status, Phase.PENDING, Reason.CREATED, "creating pods", ts)
        set_condition(status, ConditionType.CREATED, True, Reason.CREATED, "job accepted", ts)
    current = [p for p in obs.pods if p.attempt == status.attempt]
    stale = [p for p in obs.pods if p.attempt != status.attempt]

    if spec.run_policy.suspend:
        plan.delete = [p.name for p in obs.pods if not p.deleting]
        _drop_store(plan, obs)
        own = spec.run_policy.termination_grace_seconds
        plan.grace_seconds = grace["suspend"] if own is None else own
        if status.phase != Phase.SUSPENDED:
            plan.events.append(
                (EventType.NORMAL, Reason.SUSPENDED, "deleting pods; the trainer checkpoints on SIGTERM")
            )
        set_phase(
            status, Phase.SUSPENDED, Reason.SUSPENDED, "suspended: pods deleted, resume by setting suspend false", ts
        )
        set_ready(status, 0, spec.nodes)
        return plan
    if status.phase == Phase.SUSPENDED:  # resumed: a fresh attempt with a fresh rendezvous
        status.attempt += 1
        status.active_since = ts  # as for Jobs, the deadline counts from the resume
        set_phase(status, Phase.PENDING, Reason.RESUMED, "resuming from the newest checkpoint", ts)
        plan.events.append((EventType.NORMAL, Reason.RESUMED, f"starting attempt {status.attempt}"))
        current, stale = [], list(obs.pods)

    if obs.foreign:  # a job of this name was deleted and its pods are still going: never adopt or wait on them
        set_phase(
            status, status.phase or Phase.PENDING, Reason.WAITING_FOR_PREVIOUS_JOB,
            f"pods {', '.join(sorted(obs.foreign))} of a deleted job of the same name still exist", ts,
        )  # fmt: skip
        return plan

    deadline = spec.run_policy.active_deadline_seconds
    active = parse_iso(status.active_since or status.start_time)
    if deadline and active and (now - active).total_seconds() > deadline:
        return _fail(job, plan, obs, Reason.DEADLINE_EXCEEDED, f"active for more than {deadline}s", now)

    follow_recovery(plan, obs, now, elastic=spec.elastic is not None)
    if _elastic_finished(job, current) or _session_ended(job, current):
        return _succeed(job, plan, current, ts)
    failures = current_failures(job, status, obs, now)
    # A lost store needs a new gang whatever else failed: no pod is replaced alone then (the pods' own
    # failure, a lost node say, is still the one named).
    lost_store = store_lost(job, status, obs, now)
    failure = (first_failure(job, failures) or lost_store or hang(job, status, now, obs.hearing_since)
               or recovery_overdue(job, status, now))  # fmt: skip
    if failure and not lost_store and replaceable(job, status, failures, failure):
        replace_alone(job, plan, obs, failures, failure, now)
    elif failure:
        return _restart_or_fail(job, plan, obs, failure, grace["restart"], now)
    if missing_pods(job, status, obs):  # gone, but why is not known yet: no replacement, no verdict
        return plan
    _follow_size(job, plan, now)  # after the missing pods are judged by the size they were made for

    # Old attempts must be gone before the new one starts: pod names are reused.
    plan.delete += [p.name for p in stale if not p.deleting]
    # An elastic job resized below its pods: the highest indices go, with their final checkpoint (every rank
    # takes it with them); the others restart in place and train on at the next round.
    surplus = [p.name for p in current if p.index >= spec.nodes and not p.deleting]
    if surplus:
        plan.delete += surplus
        plan.events.append(
            (EventType.NORMAL, Reason.SCALING_DOWN, f"spec.nodes is {spec.nodes}: deleting {', '.join(surplus)}")
        )
    current = [p for p in current if p.index < spec.nodes]
    plan.grace_seconds = grace["restart"]
    if stale:
        set_phase(
            status,
            status.phase or Phase.PENDING,
            Reason.WAITING_FOR_OLD_PODS,
            "waiting for the previous pods to go",
            ts,
        )
        return plan

    if current and all(p.phase == PodPhase.SUCCEEDED for p in current) and len(current) == spec.nodes:
        return _succeed(job, plan, current, ts)

    present = {p.index for p in current}
    plan.create = [i for i in range(spec.nodes) if i not in present]
    plan.create_store = obs.store_listed and obs.store is None
    if trouble := store_trouble(job, obs, now):
        # Pods created now would join through a store about to go: they wait for the next one instead.
        _drop_store(plan, obs, job, now)
        plan.create = []
        set_phase(status, status.phase or Phase.PENDING, Reason.WAITING_FOR_RENDEZVOUS_STORE, trouble, ts)
        return plan
    running = [p for p in current if p.phase == PodPhase.RUNNING]
    set_ready(status, len(running), spec.nodes)
    if plan.create and not current:
        plan.events.append(
            (EventType.NORMAL, Reason.CREATING, f"creating {spec.nodes} pods for attempt {status.attempt}")
        )
    rec = recovery_of(status)
    if rec and rec.since:
        what = rec.last.pod if rec.last else "a pod"
        message = (
            f"attempt {status.attempt}: recovering in place from {what}; {len(running)}/{spec.nodes} nodes running, "
            "the others wait at the next rendezvous round"
        )
        set_phase(status, Phase.RUNNING, Reason.RECOVERING_IN_PLACE, message, ts)
    elif len(running) == spec.nodes:
        if status.phase != Phase.RUNNING:
            plan.events.append(
                (EventType.NORMAL, Reason.RUNNING, f"all {spec.nodes} nodes running (attempt {status.attempt})")
            )
        doing = "training"
        if spec.interactive:
            doing = f"interactive, JupyterLab on node 0 port {spec.interactive.port} (its log has the token)"
        set_phase(status, Phase.RUNNING, Reason.ALL_NODES_RUNNING, f"attempt {status.attempt}: {doing}", ts)
    else:
        stuck = next((p for p in sorted(current, key=_telling) if p.stuck and p.phase == PodPhase.PENDING), None)
        message = f"{len(running)}/{spec.nodes} nodes running" + (f"; pod {stuck.name}: {stuck.stuck}" if stuck else "")
        set_phase(status, Phase.STARTING, Reason.PODS_STARTING, message, ts)
    record_stuck(plan, job, current, now)
    return plan


def _telling(pod: PodView) -> tuple[bool, int]:
    """The pod whose reason says most first: a gang scheduler marks the members it could place "Schedulable"
    (waiting for the rest of the gang) and only the one that cannot be placed "Unschedulable", with why."""
    return not (pod.stuck or "").startswith(f"{UNSCHEDULABLE}:"), pod.index


def record_stuck(plan: Plan, job: ShardedTrainingJob, current: list[PodView], now: dt.datetime) -> None:
    """PodsStuck: a pod unschedulable or unable to start for schedulingTimeoutSeconds, announced once."""
    timeout = job.spec.failure_policy.scheduling_timeout_seconds
    if timeout is None:
        return
    stuck = [
        p for p in sorted(current, key=lambda p: p.index)
        if p.stuck and p.phase == PodPhase.PENDING and (since := parse_iso(p.stuck_since))
        and (now - since).total_seconds() >= timeout
    ]  # fmt: skip
    verdict = None
    if stuck:
        reason = stuck[0].stuck.split(":", 1)[0]
        verdict = (reason, f"pod {stuck[0].name} stuck for more than {timeout}s: {stuck[0].stuck}")
    announce(
        plan, ConditionType.PODS_STUCK, verdict, event=Reason.PODS_STUCK, cleared=Reason.PODS_STARTED, now=iso(now)
    )


def _follow_size(job: ShardedTrainingJob, plan: Plan, now: dt.datetime) -> None:
    """desiredNodes and currentNodes (the round rank 0 of this attempt trains in), and an event on a resize."""
    status, spec = plan.status, job.spec
    if status.desired_nodes not in (None, spec.nodes):
        plan.events.append((EventType.NORMAL, Reason.RESIZING, f"nodes {status.desired_nodes} -> {spec.nodes}"))
    status.desired_nodes = spec.nodes
    progress = status.progress
    status.current_nodes = progress.nodes if progress and progress.attempt == status.attempt else None


def _elastic_finished(job: ShardedTrainingJob, current: list[PodView]) -> bool:
    """With elastic, training is over once minNodes pods of the attempt succeeded: a pod exits 0 only when
    every rank of its round finished the last step."""
    elastic = job.spec.elastic
    return elastic is not None and sum(p.phase == PodPhase.SUCCEEDED for p in current) >= elastic.min_nodes


def _session_ended(job: ShardedTrainingJob, current: list[PodView]) -> bool:
    """An interactive job is over when JupyterLab on node 0 exited 0; the idle nodes never end by themselves."""
    return job.spec.interactive is not None and any(p.index == 0 and p.phase == PodPhase.SUCCEEDED for p in current)


def _succeed(job: ShardedTrainingJob, plan: Plan, current: list[PodView], ts: str) -> Plan:
    """Pods that never joined the last round (a replacement still pending, a straggler) are deleted, not judged."""
    status, nodes = plan.status, job.spec.nodes
    done = [p for p in current if p.phase == PodPhase.SUCCEEDED]
    plan.delete += [p.name for p in current if p.phase != PodPhase.SUCCEEDED and not p.deleting]
    status.completion_time = ts
    set_ready(status, 0, nodes)
    set_phase(status, Phase.SUCCEEDED, Reason.COMPLETED, f"all {len(done)} nodes finished", ts)
    what = "the interactive session ended" if job.spec.interactive else "training finished"
    plan.events.append((EventType.NORMAL, Reason.SUCCEEDED, f"{what} after {status.restarts} restarts"))
    return plan


def _drop_store(
    plan: Plan, obs: Observed, job: ShardedTrainingJob | None = None, now: dt.datetime | None = None
) -> None:
    """The store pod goes: nothing will rendezvous again (suspended, finished), or it cannot serve the next
    attempt. On a lost node it is deleted without grace (its name is needed for the next one)."""
    store = obs.store
    if store is None:
        return
    lost = job is not None and now is not None and node_lost(job, obs, store.node, now)
    plan.delete_store = not store.deleting or bool(lost)
    plan.store_grace = 0 if lost else None


def _restart_or_fail(job, plan: Plan, obs: Observed, failure: FailureInfo, grace: int, now: dt.datetime) -> Plan:
    """A permanent failure ends the job; a disruption restarts it without using backoffLimit (unless
    failurePolicy.countDisruptions); any other failure restarts it while the limit lasts."""
    status, fp = plan.status, job.spec.failure_policy
    status.last_failure = failure
    where = f"pod {failure.pod} (node rank {failure.node_rank}, node {failure.node})" if failure.pod else "the gang"
    detail = f"{failure.reason}: {where}" + (
        f" exited with {failure.exit_code}" if failure.exit_code is not None else ""
    )
    if is_permanent(job, failure):
        return _fail(job, plan, obs, Reason.PERMANENT_FAILURE, f"{detail}; exit code is permanent", now)
    counted = fp.count_disruptions or not is_disruption(failure)
    if counted and status.restarts >= fp.backoff_limit:
        return _fail(job, plan, obs, Reason.BACKOFF_LIMIT_EXCEEDED, f"{detail}; {fp.backoff_limit} restarts used", now)
    if counted:
        status.restarts += 1
        budget = f"restart {status.restarts}/{fp.backoff_limit}"
    else:
        status.disruptions += 1
        budget = f"disruption {status.disruptions}, not counted against backoffLimit"
    status.attempt += 1
    status.recovery = None
    plan.delete = [p.name for p in obs.pods if not p.deleting]
    if failure.reason == Reason.RENDEZVOUS_LOST or store_trouble(job, obs, now):  # made again with the next pods
        _drop_store(plan, obs, job, now)
    plan.grace_seconds = grace
    set_ready(status, 0, job.spec.nodes)
    set_phase(
        status, Phase.RESTARTING, failure.reason, f"{detail}; restarting the gang as attempt {status.attempt}", iso(now)
    )
    plan.events.append((EventType.WARNING, Reason.RESTARTING, f"{detail}; {budget}"))
    return plan


def _fail(job, plan: Plan, obs: Observed, reason: str, message: str, now: dt.datetime) -> Plan:
    status = plan.status
    status.completion_time = iso(now)
    set_ready(status, 0, job.spec.nodes)
    set_phase(status, Phase.FAILED, reason, message, iso(now))
    plan.events.append((EventType.WARNING, reason, message))
    return _finished(job, plan, obs, now)


def _finished(job: ShardedTrainingJob, plan: Plan, obs: Observed, now: dt.datetime) -> Plan:
    """cleanPodPolicy once the job has ended (the store pod goes in any case), then the TTL."""
    _drop_store(plan, obs)
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
