"""What a decision produces: the plan (the status to write, the actions to take) and the status setters
every decision step shares (phases with their conditions, announced conditions)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sharded_operator.api.reasons import EventType, Reason
from sharded_operator.api.status import Condition, ConditionType, Phase, ShardedTrainingJobStatus

# The conditions set_phase keeps in step with the phase.
PHASE_CONDITIONS = tuple(c for c in ConditionType if c.value in {p.value for p in Phase})


@dataclass
class Plan:
    """What reconcile decided: the status to write and the actions to take, in this order."""

    status: ShardedTrainingJobStatus
    create: list[int] = field(default_factory=list)  # node indices of the current attempt
    delete: list[str] = field(default_factory=list)  # pod names
    force_delete: list[str] = field(default_factory=list)  # pod names to delete with grace 0
    grace_seconds: int | None = None
    create_store: bool = False  # the rendezvous store pod, with the pods (it serves every attempt)
    delete_store: bool = False
    store_grace: int | None = None  # 0 for a store pod on a lost node: no kubelet will confirm it gone
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
    for cond in PHASE_CONDITIONS:
        on = cond.value == phase.value
        set_condition(status, cond, on, reason if on else "", message if on else "", now)
    done = phase == Phase.SUCCEEDED
    set_condition(status, ConditionType.COMPLETE, done, reason if done else "", message if done else "", now)


def record_refusal(plan: Plan, refusal: tuple[str, str] | None, now: str) -> None:
    """What the API server said to the last creates: a refusal (reason, its own message) sets the
    CreateRefused condition and, when it is new, an event; creates going through clear it."""
    announce(plan, ConditionType.CREATE_REFUSED, refusal, event=Reason.FAILED_CREATE, cleared=Reason.CREATED, now=now,
              again_on_new_message=True)  # fmt: skip
    if refusal:
        plan.status.message = f"the API server refused to create the job's pods: {refusal[1]}"


def announce(
    plan: Plan,
    type_: ConditionType,
    verdict: tuple[str, str] | None,
    *,
    event: str,
    cleared: str,
    now: str,
    again_on_new_message: bool = False,
) -> None:
    """A condition that is True while `verdict` (reason, message) holds, with a Warning event when it turns
    True (and, if asked, when its message changes); no verdict turns it False with reason `cleared`."""
    status = plan.status
    old = next((c for c in status.conditions if c.type == type_), None)
    active = old is not None and old.status == "True"
    if verdict is None:
        if active:
            set_condition(status, type_, False, cleared, "", now)
        return
    reason, message = verdict
    if not active or (again_on_new_message and old.message != message):
        plan.events.append((EventType.WARNING, event, message))
    set_condition(status, type_, True, reason, message, now)
