"""Rank 0's reports: progress and trainer events as a `contract.ProgressReport`, posted to the operator.

The post runs on a background thread, at most once per `MIN_INTERVAL`, and is skipped while the
previous one is in flight, so a slow or unreachable operator never stalls training; the next report
carries whatever was skipped (progress is a state, and events ride along until the operator answers
that they are in the job's status). Each post carries the pod's projected token, read anew every time
(the kubelet rotates it), and stays within `MAX_REPORT_BYTES` by leaving the oldest events out. At the
end, `flush` delivers the newest report, sending it again while the operator cannot be reached or asks to
retry, for at most `FLUSH_SECONDS`: the job's status shows the last step.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sharded_api.contract import (
    MAX_EVENTS,
    MAX_REPORT_BYTES,
    ProgressReport,
    TrainerEvent,
    TrainerEventType,
    TrainingProgress,
    WorkerEnv,
    iso,
)


@dataclass(frozen=True)
class ReportTarget:
    """Where to post and whom the reports are about: from the pod's environment (`contract.PodEnv`)."""

    url: str
    uid: str
    namespace: str
    name: str
    attempt: int
    token_file: str | None = None


def target_from_env() -> ReportTarget | None:
    """Where rank 0 posts progress: set by the operator in every pod, absent elsewhere (or when the operator
    reads another contract version, said once on stderr)."""
    from sharded_api.contract import CONTRACT_VERSION, PodEnv

    url, uid = os.environ.get(PodEnv.PROGRESS_URL), os.environ.get(PodEnv.JOB_UID)
    if not url or not uid:
        return None
    version = int(os.environ.get(PodEnv.CONTRACT_VERSION, CONTRACT_VERSION))
    if version != CONTRACT_VERSION:
        log(
            f"the operator reads progress reports of version {version}, this trainer writes {CONTRACT_VERSION}: "
            "progress will not reach the job's status until their releases match"
        )
        return None
    return ReportTarget(
        url=url, uid=uid, namespace=os.environ.get(PodEnv.JOB_NAMESPACE, ""), name=os.environ.get(PodEnv.JOB_NAME, ""),
        attempt=int(os.environ.get(PodEnv.ATTEMPT, "0")), token_file=os.environ.get(PodEnv.PROGRESS_TOKEN_FILE),
    )  # fmt: skip


MIN_INTERVAL = 1.0  # seconds between posts; the operator limits each pod's rate too
# How long a flush may try to deliver the final report: the operator answers the last step only once it is in
# the job's status (an API write), which on a loaded machine outlasts one post's timeout; well inside the
# restart grace period (30 s) that follows a stop.
FLUSH_SECONDS = 15.0
# Answers worth trying again: rate-limited, or the operator shedding work.
RETRY_STATUSES = (429, 503)


def log(msg: str) -> None:
    print(f"[report] {msg}", file=sys.stderr, flush=True)


class ProgressReporter:
    """Rank 0's progress and events: rewritten atomically to `path` and, in a pod, posted to the operator."""

    def __init__(self, target: ReportTarget | None, *, total_steps: int | None, path: str | None = None):
        self.target, self.path = target, Path(path) if path else None
        self.run = uuid.uuid4().hex[:12]  # tells this process's events from a restarted one's
        # torchrun's count of in-place restarts: the operator counts them in status.inPlaceRestarts.
        restart = os.environ.get(WorkerEnv.RESTART_COUNT, "0")
        nodes = os.environ.get(WorkerEnv.GROUP_WORLD_SIZE, "")  # torchrun's: the round's nodes
        self.progress: dict[str, Any] = {"step": 0, "total_steps": total_steps,
                                         "restart": int(restart) if restart.isdigit() else None,
                                         "nodes": int(nodes) if nodes.isdigit() else None}  # fmt: skip
        self.events: list[TrainerEvent] = []
        self._seq = 0
        self._lock = threading.Lock()  # events: appended by training, acknowledged by the posting thread
        self._last_post = float("-inf")
        self._posting: threading.Thread | None = None
        self._newest: bytes | None = None  # the newest report made, and the newest the operator answered
        self._answered: bytes | None = None

    @property
    def enabled(self) -> bool:
        return self.target is not None or self.path is not None

    def event(
        self, type_: TrainerEventType, message: str, *, step: int | None = None, checkpoint: dict | None = None
    ) -> None:
        """Record a trainer event; it goes out with the next update."""
        if not self.enabled:
            return
        self._seq += 1
        fields = {"seq": self._seq, "type": type_, "message": message[:1024], "step": step, "time": iso()}
        try:
            event = TrainerEvent.model_validate({**fields, "checkpoint": checkpoint})
        except ValidationError as e:  # a checkpoint path beyond the contract's bound: the event still counts
            log(f"leaving the checkpoint out of a {type_.value} event: {e.errors()[0]['msg']}")
            event = TrainerEvent.model_validate(fields)
        with self._lock:
            self.events.append(event)
            del self.events[:-MAX_EVENTS]

    def checkpoint_committed(self, committed: dict) -> None:
        """A checkpoint's marker was written: an event, and the newest checkpoint in progress."""
        self.event(
            TrainerEventType.CHECKPOINT_COMMITTED, f"checkpoint at step {committed['step']} committed",
            step=committed["step"], checkpoint=committed,
        )  # fmt: skip
        self.update(last_checkpoint=committed)

    def update(self, **fields: Any) -> None:
        """Merge progress fields (snake_case names of `TrainingProgress`), then write and post."""
        if not self.enabled:
            return
        self.progress.update({k: v for k, v in fields.items() if v is not None})
        progress = self._valid({**self.progress, "updated_at": iso()})
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(progress.model_dump_json(by_alias=True, exclude_none=True))
            os.replace(tmp, self.path)
        if self.target:
            body = self._newest = self._body(progress)
            busy = self._posting is not None and self._posting.is_alive()
            if busy or time.monotonic() - self._last_post < MIN_INTERVAL:
                return  # the next update or flush sends the newest state
            self._last_post = time.monotonic()
            self._posting = threading.Thread(target=self._post, args=(body,), daemon=True)
            self._posting.start()

    def _body(self, progress: TrainingProgress) -> bytes:
        """The report as JSON, leaving out the oldest events until it fits the operator's limit."""
        assert self.target is not None
        t = self.target
        with self._lock:
            events = list(self.events)
        while True:
            report = ProgressReport(
                **progress.model_dump(), uid=t.uid, namespace=t.namespace, name=t.name, attempt=t.attempt,
                run=self.run, events=events,
            )  # fmt: skip
            body = report.model_dump_json(by_alias=True, exclude_none=True).encode()
            if len(body) <= MAX_REPORT_BYTES or not events:
                return body
            events = events[1:]

    @staticmethod
    def _valid(fields: dict[str, Any]) -> TrainingProgress:
        """The fields as `TrainingProgress`, leaving out any value the contract refuses (a NaN loss after a diverged
        step, say) rather than failing training over a report."""
        fields = {k: v for k, v in fields.items() if not (isinstance(v, float) and not math.isfinite(v))}
        try:
            return TrainingProgress.model_validate(fields)
        except ValidationError as e:
            names = {f.alias or n: n for n, f in TrainingProgress.model_fields.items()}  # errors name by alias
            bad = {names.get(str(err["loc"][0]), str(err["loc"][0])) for err in e.errors() if err["loc"]}
            log(f"leaving {sorted(bad)} out of the progress report: {e.errors()[0]['msg']}")
            return TrainingProgress.model_validate({k: v for k, v in fields.items() if k not in bad})

    def _post(self, body: bytes, timeout: float = 5.0) -> None:
        """One post of `body`; `_answered` becomes it once the operator has answered it for good (taken, or
        refused for a reason that sending it again would not change)."""
        assert self.target is not None
        url, headers = self.target.url, {"Content-Type": "application/json"}
        if self.target.token_file:
            try:
                headers["Authorization"] = "Bearer " + Path(self.target.token_file).read_text().strip()
            except OSError as e:  # not mounted yet, or being rotated: the operator will say 401
                log(f"cannot read the progress token {self.target.token_file}: {e}")
        req = urllib.request.Request(url, data=body, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as reply:
                answer = json.loads(reply.read(4096) or b"{}")
        except urllib.error.HTTPError as e:  # refused: say why, once per report
            log(f"progress report refused by {url}: {e.code} {e.read()[:500].decode(errors='replace')}")
            if e.code not in RETRY_STATUSES:
                self._answered = body
            return
        except (OSError, ValueError) as e:  # the operator restarting or unreachable: the next update tries again
            log(f"progress report to {url} failed: {e}")
            return
        self._answered = body
        acknowledged = answer.get("acknowledged") if isinstance(answer, dict) else None
        if isinstance(acknowledged, int):  # those events are in the job's status: stop re-sending them
            with self._lock:
                self.events = [e for e in self.events if e.seq > acknowledged]

    def flush(self, seconds: float = FLUSH_SECONDS) -> None:
        """Deliver the newest report before the process exits, so the final state and events are not lost:
        wait for the post in flight, then send the newest report if it was skipped or its post failed,
        again while the operator cannot be reached or asks to retry, for at most `seconds`."""
        deadline = time.monotonic() + seconds
        if self._posting:
            self._posting.join(seconds)
        while self.target and self._newest is not None and self._answered is not self._newest:
            left = deadline - time.monotonic()
            if left <= 0:
                log(f"the last progress report did not reach {self.target.url} within {seconds:g} s")
                return
            self._post(self._newest, timeout=min(left, 5.0))
            if self._answered is not self._newest:
                time.sleep(min(0.5, max(deadline - time.monotonic(), 0)))
