"""Every reason the operator writes, in one place (as JobSet keeps its constants): the reasons of conditions
and of the phase, of `status.lastFailure`, and of the job's Kubernetes events, with the events' types.

A reason is a machine-readable CamelCase word (`kubectl get events --field-selector reason=...`, alerts on
`lastFailure.reason`); the message beside it is for people. Reasons the API server or the kubelet write
(a refused create's, a pod's waiting reason) are passed on as they come, never spelled here.
"""

from __future__ import annotations

from enum import StrEnum


class EventType(StrEnum):
    """The two types of Kubernetes events."""

    NORMAL = "Normal"
    WARNING = "Warning"


class Reason(StrEnum):
    """Why a job is where it is, why an attempt failed, what an event says happened."""

    # The phase and its conditions.
    CREATED = "Created"
    CREATING = "Creating"
    PODS_STARTING = "PodsStarting"
    PODS_STARTED = "PodsStarted"
    ALL_NODES_RUNNING = "AllNodesRunning"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    RECOVERING_IN_PLACE = "RecoveringInPlace"
    RECOVERED_IN_PLACE = "RecoveredInPlace"
    REPLACING_POD = "ReplacingPod"
    RESIZING = "Resizing"
    SCALING_DOWN = "ScalingDown"
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"
    WAITING_FOR_PREVIOUS_JOB = "WaitingForPreviousJob"
    WAITING_FOR_OLD_PODS = "WaitingForOldPods"
    WAITING_FOR_RENDEZVOUS_STORE = "WaitingForRendezvousStore"
    PODS_STUCK = "PodsStuck"
    FAILED_CREATE = "FailedCreate"
    CREATE_REFUSED = "CreateRefused"
    FORCE_DELETED = "ForceDeleted"
    # The end.
    COMPLETED = "Completed"
    SUCCEEDED = "Succeeded"
    PERMANENT_FAILURE = "PermanentFailure"
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    INVALID_SPEC = "InvalidSpec"
    # Failures of an attempt (`lastFailure.reason`): the trainer's ...
    ERROR = "Error"
    HANG = "Hang"
    STARTUP_TIMEOUT = "StartupTimeout"
    RENDEZVOUS_LOST = "RendezvousLost"
    IN_PLACE_RECOVERY_TIMEOUT = "InPlaceRecoveryTimeout"
    # ... and the infrastructure's (disruptions: they do not count against backoffLimit).
    NODE_LOST = "NodeLost"
    EVICTED = "Evicted"
    DISRUPTION_TARGET = "DisruptionTarget"
    PREEMPTED = "Preempted"
    POD_VANISHED = "PodVanished"
    POD_DELETED = "PodDeleted"
