"""What reconcile observes, reduced to what decisions need: pods of a job, the nodes, rank 0's report."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from typing import Any

from sharded_api.contract import iso, parse_iso
from sharded_operator.api.models import CONTAINER, LABEL_ATTEMPT, LABEL_INDEX
from sharded_operator.api.status import PodPhase

# Kubernetes pod phases (the pod's, not the job's).
POD_FINISHED = (PodPhase.SUCCEEDED, PodPhase.FAILED)


# The PodScheduled reason of a pod no node can take (core/v1 PodReasonUnschedulable); gang schedulers also
# write other reasons (Volcano: "Schedulable" for a member waiting on the rest of its gang).
UNSCHEDULABLE = "Unschedulable"
# Container waiting reasons that do not go away by waiting: the pod needs someone's attention.
STUCK_WAITING = frozenset(
    {"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerConfigError", "CreateContainerError"}
)


def _stuck(status: dict[str, Any], meta: dict[str, Any]) -> tuple[str | None, str | None]:
    """(why, since when) a pod is not running: the scheduler's verdict or a container that cannot start."""
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason"):
            return f"{c['reason']}: {c.get('message', '')}".rstrip(": "), _normal(c.get("lastTransitionTime"))
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in STUCK_WAITING:
            reason = f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")
            return reason, _normal(status.get("startTime") or meta.get("creationTimestamp"))
    return None, None


def controller_uid(meta: dict[str, Any]) -> str | None:
    """The UID in an object's controller owner reference: which job, of all that had this name, made it."""
    return next((r.get("uid") for r in meta.get("ownerReferences") or [] if r.get("controller")), None)


def _normal(t: str | None) -> str | None:
    """One spelling of times, so they compare as strings (the client writes +00:00, the API server Z)."""
    parsed = parse_iso(t)
    return iso(parsed) if parsed else None


def _deletion_requested(meta: dict[str, Any]) -> str | None:
    """deletionTimestamp is when the grace period ends; the request was that grace earlier."""
    end = parse_iso(meta.get("deletionTimestamp"))
    if end is None:
        return None
    return iso(end - dt.timedelta(seconds=meta.get("deletionGracePeriodSeconds") or 0))


@dataclass(frozen=True, slots=True)
class JobView:
    """A job as the operator's index keeps it between reconciles: its JSON, and the fields read across every
    job. The body parsed back into dicts would take about four times the memory (17 KB a job, measured:
    17 MB at 1,000 jobs); a reconcile parses the one job it looks at."""

    raw: bytes
    phase: str | None
    host_port: int | None
    deleting: bool

    @classmethod
    def from_job(cls, job: dict[str, Any]) -> JobView:
        meta = {k: v for k, v in job["metadata"].items() if k != "managedFields"}  # never read; large
        status = job.get("status") or {}
        return cls(raw=json.dumps({**job, "metadata": meta}, separators=(",", ":")).encode(), phase=status.get("phase"),
                   host_port=status.get("hostPort"), deleting=bool(meta.get("deletionTimestamp")))  # fmt: skip

    def body(self) -> dict[str, Any]:
        return json.loads(self.raw)


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
    disruption: str | None = None  # why the API server marked the pod DisruptionTarget, if it did
    finished_at: str | None = None  # when the trainer container terminated
    deleted_at: str | None = None  # when the pod's deletion was requested
    grace_ends: str | None = None  # when its grace period ends (deletionTimestamp)
    owner_uid: str | None = None  # UID of the job that created it (its controller reference)
    uid: str | None = None
    stuck: str | None = None  # why a pod that should run does not: unschedulable, image pull, config
    stuck_since: str | None = None

    @classmethod
    def from_pod(cls, pod: dict[str, Any]) -> PodView:
        meta, status = pod["metadata"], pod.get("status") or {}
        term = None
        for cs in status.get("containerStatuses") or []:
            if cs.get("name") == CONTAINER or term is None:
                term = (cs.get("state") or {}).get("terminated") or term
        conditions = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
        target = conditions.get("DisruptionTarget")
        stuck, stuck_since = _stuck(status, meta)
        labels = meta.get("labels") or {}
        return cls(
            name=meta["name"],
            index=int(labels.get(LABEL_INDEX, -1)),
            attempt=int(labels.get(LABEL_ATTEMPT, 0)),
            phase=status.get("phase") or PodPhase.PENDING,
            node=(pod.get("spec") or {}).get("nodeName"),
            deleting=bool(meta.get("deletionTimestamp")),
            ready="Ready" in conditions,
            exit_code=term.get("exitCode") if term else None,
            reason=(term or {}).get("reason") or status.get("reason"),
            message=(term or {}).get("message") or status.get("message") or "",
            disruption=f"{target.get('reason')}: {target.get('message', '')}".rstrip(": ") if target else None,
            finished_at=_normal((term or {}).get("finishedAt")),
            deleted_at=_deletion_requested(meta),
            grace_ends=_normal(meta.get("deletionTimestamp")),
            owner_uid=controller_uid(meta),
            uid=meta.get("uid"),
            stuck=stuck,
            stuck_since=stuck_since,
        )


@dataclass(frozen=True)
class NodeView:
    """A node's readiness: `since` is when a node not Ready stopped being Ready (RFC 3339)."""

    ready: bool = True
    since: str | None = None

    @classmethod
    def from_node(cls, node: dict[str, Any]) -> NodeView:
        """A status that cannot be read counts as not Ready since an unknown time: never Ready, never lost."""
        try:
            conditions = (node.get("status") or {}).get("conditions") or []
            ready = next((c for c in conditions if c.get("type") == "Ready"), None)
            if ready is None:
                return cls(ready=False)
            if ready.get("status") == "True":  # when it became Ready decides nothing: a heartbeat moving it is no news
                return cls(ready=True)
            return cls(ready=False, since=_normal(ready.get("lastTransitionTime")))
        except (AttributeError, TypeError, ValueError):
            return cls(ready=False)


@dataclass(frozen=True)
class Observed:
    pods: list[PodView]
    nodes: dict[str, NodeView] | None = None  # existing nodes by name; None if not known
    # The last state of pods already gone from the API server, as their deletion event carried it: a pod
    # deleted at once (grace 0, or no kubelet) is never listed while Terminating.
    departed: dict[str, PodView] = field(default_factory=dict)
    # When each pod of the current attempt was first found missing (its deletion event may still be on
    # its way: the watch and the list are not ordered).
    missing_since: dict[str, str] = field(default_factory=dict)
    # Pods already missing when this process first looked at the job: they went while it was not watching
    # (down, or not yet started), so why they went cannot be known.
    unwatched: frozenset[str] = frozenset()
    # Since when the operator has been able to hear every report (election.Hearing); None: as long as any
    # timer needs. The hang and startup timers count from no earlier.
    hearing_since: str | None = None
    # Pods with this job's name label made by another job of the same name (deleted, still terminating):
    # they hold names this job's pods need.
    foreign: list[str] = field(default_factory=list)
    # The rendezvous store pod (None: it does not exist), when reconcile looked for it (`store_listed`).
    store: PodView | None = None
    store_listed: bool = False
