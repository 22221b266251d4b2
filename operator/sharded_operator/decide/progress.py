"""Progress reports from training pods, pure: who may send one, and what it changes in the job's status.

A report is believed only from a live pod of the job's current attempt. The pod proves who it is with a
projected ServiceAccount token minted for the operator's audience and bound to the pod (the kubelet
mints and rotates it; the API server's TokenReview verifies it and fails once the pod is gone). The
token names the pod; the pod's labels and owner say which job and attempt it belongs to; only then is
the report's content looked at, and it is merged into status by `merge_report`, the one place that
writes `status.progress`, `lastCheckpoint`, `resumedFrom` and the trainer-event cursor.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

from sharded_api.contract import ProgressReport, StepProgress, TrainerEventType, parse_iso
from sharded_operator.api.models import LABEL_ATTEMPT, LABEL_JOB
from sharded_operator.api.reasons import EventType
from sharded_operator.api.status import CheckpointStatus, Progress, ShardedTrainingJobStatus, TrainerEventCursor
from sharded_operator.decide.views import controller_uid

# Status fields only reports write; reconcile leaves them alone (its patch never names them).
_WRITTEN = ("progress", "last_checkpoint", "resumed_from", "export", "last_trainer_event", "in_place_restarts")
REPORT_FIELDS = tuple(ShardedTrainingJobStatus.model_fields[n].alias or n for n in _WRITTEN)
MAX_TOKEN_BYTES = 8192
# Claims the API server puts into a token bound to a pod (and returns as `extra` of a TokenReview).
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
# How each trainer event shows among the job's Kubernetes events.
EVENT_TYPES = {
    TrainerEventType.CHECKPOINT_SET_ASIDE: EventType.WARNING,
    TrainerEventType.INCOMPATIBLE_CHECKPOINT: EventType.WARNING,
}


class Refusal(Exception):
    """A report not taken: the HTTP status to answer with and why."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


@dataclass(frozen=True)
class Sender:
    """Who a verified token says sent a report: a ServiceAccount, through one pod."""

    namespace: str
    service_account: str
    pod_name: str
    pod_uid: str


def bearer(header: str | None) -> str:
    """The token of an `Authorization: Bearer` header, or a 401."""
    scheme, _, token = (header or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Refusal(401, "a progress report needs the pod's projected ServiceAccount token as a Bearer token")
    if len(token) > MAX_TOKEN_BYTES:
        raise Refusal(401, "token too long")
    return token


def precheck(token: str, audience: str, now: float) -> None:
    """Refuse what cannot be a pod-bound token for this audience without asking the API server, so junk
    costs no TokenReview. Nothing here is trusted: the TokenReview verifies the signature."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError, binascii.Error, UnicodeDecodeError):
        raise Refusal(401, "not a ServiceAccount token") from None
    if not isinstance(claims, dict):
        raise Refusal(401, "not a ServiceAccount token")
    aud = claims.get("aud")
    if audience not in (aud if isinstance(aud, list) else [aud]):
        raise Refusal(401, f"the token's audience is not {audience!r}: mount a projected token for it")
    exp = claims.get("exp")
    if not isinstance(exp, int | float) or exp <= now:
        raise Refusal(401, "the token has expired")
    if not isinstance((claims.get("kubernetes.io") or {}).get("pod"), dict):
        raise Refusal(401, "the token is not bound to a pod")


def sender_from_review(status: dict[str, Any], audience: str) -> Sender:
    """The sender a TokenReview's status vouches for, or a 401."""
    if not status.get("authenticated"):
        raise Refusal(401, f"token not accepted: {str(status.get('error') or 'unauthenticated')[:200]}")
    if audience not in (status.get("audiences") or []):
        raise Refusal(401, f"the token is not for audience {audience!r}")
    user = status.get("user") or {}
    parts = str(user.get("username", "")).split(":")
    extra = user.get("extra") or {}
    pod_name, pod_uid = (extra.get(POD_NAME_EXTRA) or [""])[0], (extra.get(POD_UID_EXTRA) or [""])[0]
    if len(parts) != 4 or parts[:2] != ["system", "serviceaccount"] or not pod_name or not pod_uid:
        raise Refusal(401, "the token is not a ServiceAccount token bound to a pod")
    return Sender(namespace=parts[2], service_account=parts[3], pod_name=pod_name, pod_uid=pod_uid)


def check_sender(report: ProgressReport, sender: Sender, pod: dict[str, Any] | None) -> None:
    """A report is taken only from a live pod of the job and attempt it is about; otherwise a 403."""
    if sender.namespace != report.namespace:
        raise Refusal(403, f"a pod of namespace {sender.namespace} cannot report for namespace {report.namespace}")
    meta = (pod or {}).get("metadata") or {}
    if not meta or meta.get("uid") != sender.pod_uid or meta.get("deletionTimestamp"):
        raise Refusal(403, f"pod {sender.pod_name} is gone or being deleted")
    labels = meta.get("labels") or {}
    if labels.get(LABEL_JOB) != report.name or controller_uid(meta) != report.uid:
        raise Refusal(403, f"pod {sender.pod_name} does not belong to job {report.namespace}/{report.name}")
    if (attempt := labels.get(LABEL_ATTEMPT)) != str(report.attempt):
        raise Refusal(403, f"pod {sender.pod_name} belongs to attempt {attempt}, not {report.attempt}")


def merge_report(
    status: ShardedTrainingJobStatus, report: ProgressReport, now: str
) -> tuple[dict[str, Any], list[tuple[str, str, str]]]:
    """The status fields a report of the current attempt changes (a merge patch of REPORT_FIELDS) and the
    Kubernetes events for its trainer events not reported yet (type, reason, message).

    `observedAt` is when the operator first took this report: hang detection runs on the operator's
    clock, from the attempt's newest report, whatever the trainer's clock says.
    """
    if report.attempt != status.attempt:
        raise Refusal(403, f"the report is about attempt {report.attempt}; the job is at attempt {status.attempt}")
    old = status.progress
    if superseded(old, report):
        return {}, []  # status already holds a newer one (another replica wrote it): nothing goes backwards
    same = old is not None and (old.attempt, old.step, old.updated_at) == (report.attempt, report.step,
                                                                           report.updated_at)  # fmt: skip
    # Every field of the contract's StepProgress, as reported: status.progress is built from that model.
    reported = report.model_dump(include=set(StepProgress.model_fields))
    progress = Progress(
        **reported, attempt=report.attempt, run=report.run, observed_at=old.observed_at if same and old else now
    )
    patch: dict[str, Any] = {"progress": progress}
    if restarted_in_place(old, report):
        patch["in_place_restarts"] = status.in_place_restarts + 1
    if report.last_checkpoint:
        patch["last_checkpoint"] = CheckpointStatus(**report.last_checkpoint.model_dump())
    seen = acknowledged(status, report)
    new = [e for e in report.events if e.seq > seen]
    events = []
    for e in new:
        events.append((EVENT_TYPES.get(e.type, EventType.NORMAL), e.type.value, e.message))
        if e.type == TrainerEventType.RESUMED and e.checkpoint:
            patch["resumed_from"] = CheckpointStatus.model_validate(e.checkpoint.model_dump())
        if e.type == TrainerEventType.EXPORT_WRITTEN and e.checkpoint:
            patch["export"] = CheckpointStatus.model_validate(e.checkpoint.model_dump())
    if new:
        patch["last_trainer_event"] = TrainerEventCursor(attempt=report.attempt, run=report.run, seq=new[-1].seq)
    names = ShardedTrainingJobStatus.model_fields
    dump = {
        names[k].alias or k: v.model_dump(by_alias=True, exclude_none=True, mode="json") if hasattr(v, "model_dump")
        else v
        for k, v in patch.items()
    }  # fmt: skip
    return dump, events


def superseded(old: Progress | None, report: ProgressReport) -> bool:
    """Whether status already holds a newer report of this attempt than `report`: a later step of the same
    trainer process (or the same step, later), or any report of a process that started after it. Replicas
    take reports side by side; one holding an older report must not write it over a newer one."""
    if old is None or old.attempt != report.attempt:
        return False
    new, before = parse_iso(report.updated_at), parse_iso(old.updated_at)
    if old.run in (None, report.run):
        return report.step < old.step or (report.step == old.step and new is not None and before is not None
                                          and new < before)  # fmt: skip
    return new is not None and before is not None and new < before  # a late report of an earlier process


def restarted_in_place(old: Progress | None, report: ProgressReport) -> bool:
    """A new trainer process reporting for the same attempt: torchrun restarted the workers in place (every
    node's, so rank 0's too). Counted by the process, not torchrun's restart count, which only the node whose
    worker failed increments. A late report of an earlier process (older by the trainer's clock) is not one."""
    if old is None or old.attempt != report.attempt or old.run in (None, report.run) or old.updated_at is None:
        return False
    new, before = parse_iso(report.updated_at), parse_iso(old.updated_at)
    return new is not None and before is not None and new > before  # restarts take seconds


def acknowledged(status: ShardedTrainingJobStatus, report: ProgressReport) -> int:
    """The last event of this trainer run that is in status: the trainer stops re-sending it and older ones."""
    cursor = status.last_trainer_event
    return cursor.seq if cursor and (cursor.attempt, cursor.run) == (report.attempt, report.run) else 0
