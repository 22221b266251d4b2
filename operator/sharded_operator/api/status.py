"""The ShardedTrainingJob status: phases, conditions, progress, checkpoints, failures, in-place recovery."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import ConfigDict, Field

from sharded_api.contract import CheckpointRef, IsoTime, Step, StepProgress
from sharded_operator.api.spec import ApiModel


class Phase(StrEnum):
    """Where a job is in its lifecycle: Pending -> Starting -> Running (-> Restarting -> Running)* -> an end."""

    PENDING = "Pending"
    STARTING = "Starting"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"


FINISHED = frozenset({Phase.SUCCEEDED, Phase.FAILED})


class PodPhase(StrEnum):
    """A pod's phase, as the kubelet reports it (not the job's)."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    UNKNOWN = "Unknown"


class ConditionType(StrEnum):
    """Condition types in status.conditions: one per phase but Pending and Starting, and a few of their own."""

    CREATED = "Created"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    # True with Succeeded: the name batch Jobs and JobSet use, so `kubectl wait --for=condition=Complete`
    # scripts written for them work unchanged.
    COMPLETE = "Complete"
    CREATE_REFUSED = "CreateRefused"  # the API server refused a child (policy, quota, invalid object)
    PODS_STUCK = "PodsStuck"  # a pod could not be scheduled or started for schedulingTimeoutSeconds


class StatusModel(ApiModel):
    """Base of the status models: keys a newer operator wrote are ignored, not refused, on a downgrade."""

    model_config = ConfigDict(extra="ignore")


class Condition(StatusModel):
    """A Kubernetes-style condition."""

    type: str = Field(
        ..., description="Created, Running, Restarting, Suspended, Succeeded (and Complete with it), Failed, "
        "CreateRefused or PodsStuck.",
    )  # fmt: skip
    status: Literal["True", "False", "Unknown"] = Field(..., description="True, False or Unknown.")
    reason: str = Field("", description="CamelCase reason for the last transition.")
    message: str = Field("", description="Human-readable detail.")
    last_transition_time: str | None = Field(None, description="When status last changed (RFC 3339).")


class Progress(StatusModel, StepProgress):
    """Training progress: the contract's fields as rank 0 reported them, with the report's attempt and trainer
    process and when the operator first saw it."""

    model_config = ConfigDict(extra="ignore", frozen=False)

    # Read leniently: a status is read whatever wrote it, and a job with no report yet has step 0.
    step: Step = Field(0, description=StepProgress.model_fields["step"].description)
    updated_at: IsoTime | None = Field(None, description=StepProgress.model_fields["updated_at"].description)
    attempt: int | None = Field(None, ge=0, description="Attempt the report came from.")
    run: str | None = Field(None, description="The reporting trainer process (a new one after each in-place restart).")
    observed_at: str | None = Field(
        None, description="When the operator first saw this report (its clock; hang detection counts from here)."
    )


class CheckpointStatus(StatusModel, CheckpointRef):
    """The newest complete checkpoint, as the trainer reported it."""

    model_config = ConfigDict(extra="ignore", frozen=False)


class FailureInfo(StatusModel):
    """The last failure that ended an attempt."""

    pod: str | None = Field(None, description="Failed pod.")
    node: str | None = Field(None, description="Kubernetes node the pod ran on.")
    node_rank: int | None = Field(None, description="The pod's torchrun node rank.")
    exit_code: int | None = Field(None, description="Exit code of the trainer container.")
    reason: str = Field(..., description="e.g. Error, OOMKilled, Evicted, NodeLost, Hang, InvalidSpec.")
    message: str = Field("", description="Detail.")
    attempt: int | None = Field(None, description="Attempt that failed.")
    time: str | None = Field(None, description="When it was observed (RFC 3339).")


class InPlaceRecovery(StatusModel):
    """Pods of the current attempt replaced alone (failurePolicy.inPlaceRestarts), and whether training resumed."""

    attempt: int = Field(..., description="The attempt these replacements belong to.")
    replacements: int = Field(0, ge=0, description="Pods replaced alone in this attempt.")
    since: str | None = Field(
        None, description="When the last pod was replaced; unset once a new trainer process reported progress."
    )
    run: str | None = Field(None, description="The trainer process that reported last before that replacement.")
    pending: list[int] = Field(
        default_factory=list, max_length=1024, description="Node indices whose replacement pod is not created yet."
    )
    retired: list[str] = Field(
        default_factory=list, max_length=1024, description="UIDs of replaced pods still going away: not failures."
    )
    last: FailureInfo | None = Field(None, description="The failure the last replacement recovered from.")


class TrainerEventCursor(StatusModel):
    """Which trainer events have been reported, so none is reported twice (across operator restarts too)."""

    attempt: int = Field(..., description="Attempt of the trainer run that sent them.")
    run: str = Field(..., description="Random id of that trainer process (a restarted worker has a new one).")
    seq: int = Field(..., description="Sequence number of the last event reported.")


class ShardedTrainingJobStatus(StatusModel):
    """Observed state of a ShardedTrainingJob."""

    phase: Phase | None = Field(
        None, description="Pending, Starting, Running, Restarting, Succeeded, Failed, Suspended."
    )
    message: str | None = Field(None, description="Why the job is in this phase.")
    conditions: list[Condition] = Field(default_factory=list, description="Kubernetes-style conditions.")
    ready: str | None = Field(None, description="Running pods / nodes, e.g. 3/4.")
    ready_nodes: int = Field(0, description="Pods of the current attempt that are running.")
    desired_nodes: int | None = Field(None, description="spec.nodes as last acted on.")
    current_nodes: int | None = Field(
        None, description="Nodes training now: the current attempt's rendezvous round, as its rank 0 reports it."
    )
    attempt: int = Field(0, description="Current attempt (a fresh gang and rendezvous id each).")
    restarts: int = Field(0, description="Gang restarts so far (counted against backoffLimit).")
    disruptions: int = Field(
        0, description="Restarts caused by disruptions (evictions, preemption, node loss), not counted as failures."
    )
    in_place_restarts: int = Field(
        0,
        description="Worker restarts inside running pods (failurePolicy.inPlaceRestarts), over every attempt; no "
        "pod was recreated for them.",
    )
    pod_replacements: int = Field(
        0,
        description="Pods replaced alone while the others kept running (over every attempt); gang restarts are "
        "restarts and disruptions.",
    )
    recovery: InPlaceRecovery | None = Field(None, description="In-place recovery of the current attempt.")
    progress: Progress | None = Field(None, description="Live training progress.")
    last_checkpoint: CheckpointStatus | None = Field(None, description="Newest complete checkpoint.")
    export: CheckpointStatus | None = Field(
        None, description="The Hugging Face directory the trainer exported at the end (trainer.exportOnSuccess)."
    )
    resumed_from: CheckpointStatus | None = Field(
        None,
        description="The checkpoint training last resumed from (one an earlier job of this name left on a "
        "retained claim, too).",
    )
    last_failure: FailureInfo | None = Field(None, description="Last failure that ended an attempt.")
    host_port: int | None = Field(
        None,
        description="With network.hostNetwork: the port the job's pods bind on their nodes (the rendezvous), "
        "chosen from the operator's hostPortRange and declared as a hostPort.",
    )
    start_time: str | None = Field(None, description="When the job first started (RFC 3339).")
    active_since: str | None = Field(
        None, description="When the job last became active: its start or its last resume (activeDeadlineSeconds)."
    )
    completion_time: str | None = Field(None, description="When the job succeeded or failed (RFC 3339).")
    observed_generation: int | None = Field(None, description="metadata.generation the status reflects.")
    last_trainer_event: TrainerEventCursor | None = Field(
        None, description="The last trainer event already turned into status and a Kubernetes event."
    )
