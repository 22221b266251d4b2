"""Progress reports, taken: authenticate, validate, rate-limit, and write them into the job's status.

A report is taken only from a live pod of the job's current attempt (the checks: `progress`): its Bearer
token is verified offline against the cluster's service-account issuer keys (`issuer`), so forged tokens
cost no API call and cannot crowd out a real pod (only where the API server publishes no keys does a
rate-limited TokenReview verify it, junk refused before), its body by the contract's `ProgressReport`,
each pod is rate-limited, and the accepted report is written into the job's status by whichever replica
took it, at most once per `progressWriteSeconds` per job so the API server sees a bounded write rate (a
report with a new trainer event, or of the last step, at once). Nothing that matters is held only in
memory, and what is held (caches, rate limits, the newest report per job awaiting its write) is keyed by
verified senders and pruned, so memory is bounded by the live jobs whatever is posted.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from sharded_api.contract import MAX_REPORT_BYTES, ProgressReport, iso
from sharded_api.loading import format_validation_error
from sharded_operator.api.status import ShardedTrainingJobStatus
from sharded_operator.decide.progress import (
    Refusal,
    Sender,
    acknowledged,
    bearer,
    check_sender,
    merge_report,
    precheck,
    sender_from_review,
)
from sharded_operator.run.issuer import IssuerKeys, key_id
from sharded_operator.run.k8s import Kube
from sharded_operator.run.web import Metrics
from sharded_operator.settings import OperatorSettings

logger = logging.getLogger("sharded_operator.run.intake")
IDLE_SECONDS = 600  # per-job and per-pod state not touched for this long is dropped
# The progress work's own threads (pod reads, report writes, events): apart from the reconcilers' and the
# Lease's, so that neither waits behind reports. Past MAX_PENDING calls waiting, reports are shed (503).
PROGRESS_THREADS = 8
MAX_PENDING = 64


class TTLCache:
    """A bounded map whose entries expire: the oldest goes first when it is full."""

    def __init__(self, size: int, ttl: float, clock: Callable[[], float] = time.monotonic):
        self.size, self.ttl, self.clock = size, ttl, clock
        self._items: OrderedDict[str, tuple[float, Any]] = OrderedDict()

    def get(self, key: str) -> Any:
        entry = self._items.get(key)
        if entry is None or entry[0] < self.clock():
            self._items.pop(key, None)
            return None
        return entry[1]

    def put(self, key: str, value: Any) -> None:
        self._items[key] = (self.clock() + self.ttl, value)
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


class Bucket:
    """A token bucket: `rate` per second, up to `burst` at once."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens, self.at = burst, clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


@dataclass
class JobDesk:
    """Per job (by UID): the newest accepted report not yet written, and when the last write was."""

    report: ProgressReport | None = None
    written_at: float = float("-inf")
    touched: float = 0.0
    cursor: tuple[int, str, int] | None = None  # (attempt, run, seq) of the trainer events last written
    lock: asyncio.Lock | None = None


class ProgressDesk:
    """Takes progress reports: authenticate, validate, rate-limit, and write them into job status."""

    def __init__(self, kube: Kube, settings: OperatorSettings, metrics: Metrics,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 cached: Callable[[str, str], dict[str, Any] | None] = lambda namespace, name: None):  # fmt: skip
        self.kube, self.settings, self.metrics, self.clock, self.wall = kube, settings, metrics, clock, wall
        self.cached = cached  # the job as the watch last showed it: a write tries that version first
        self.issuer = IssuerKeys(kube.issuer_discovery, kube.issuer_keys, clock)
        self._refreshing = asyncio.Lock()
        self.verified = TTLCache(4096, 60, clock)  # token digest -> the Sender it proved
        self.failing = False  # a write of a report failed at the last flush (the API server away): status lags
        self.reviews = TTLCache(4096, 60, clock)  # token digest -> Sender or Refusal (TokenReview only)
        self.pods = TTLCache(4096, 5, clock)  # pod uid -> the pod as last read
        self.review_budget = Bucket(settings.token_reviews_per_second, settings.token_reviews_per_second * 2, clock)
        self.per_pod: dict[str, tuple[float, Bucket]] = {}  # verified pod uid -> (last used, its bucket)
        self.jobs: dict[str, JobDesk] = {}
        self.pool = ThreadPoolExecutor(PROGRESS_THREADS, thread_name_prefix="progress")
        self.pending = 0  # API calls of the progress work in flight or queued

    async def _run(self, fn, *args):
        """`fn(*args)` on the progress work's own threads. Past `MAX_PENDING` calls in flight or queued the
        report is shed with 503 (the trainer sends the next one a few seconds later): a slow API server
        queues a bounded amount of progress work, and none of it ahead of anything else's."""
        if self.pending >= MAX_PENDING:
            raise Refusal(503, "the operator is busy; try again")
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        finally:
            self.pending -= 1

    async def take(self, authorization: str | None, body: bytes) -> tuple[int, dict[str, Any]]:
        """The answer to one POST: (HTTP status, JSON body). Nothing changes unless it is 200."""
        try:
            if len(body) > MAX_REPORT_BYTES:
                raise Refusal(413, f"a report is at most {MAX_REPORT_BYTES} bytes")
            sender = await self._sender(authorization)
            try:
                report = ProgressReport.model_validate_json(body)
            except ValidationError as e:
                raise Refusal(422, format_validation_error(e)) from None
            self._limit(sender)
            pod = self.pods.get(sender.pod_uid)
            if pod is None:
                pod = await self._run(self.kube.get_pod, sender.namespace, sender.pod_name)
                if pod is not None:
                    self.pods.put(sender.pod_uid, pod)
            check_sender(report, sender, pod)
            answer = await self._accept(report)
        except Refusal as r:
            self.metrics.progress_reports.labels(str(r.status)).inc()
            return r.status, {"error": r.reason}
        self.metrics.progress_reports.labels("200").inc()
        return 200, answer

    async def _sender(self, authorization: str | None) -> Sender:
        token = bearer(authorization)
        key = hashlib.sha256(token.encode()).hexdigest()
        if (known := self.verified.get(key)) is not None:
            return known
        kid = key_id(token)
        if self.issuer.wants_refresh(kid):
            async with self._refreshing:  # a flood of unknown key ids waits for one fetch, not one each
                if self.issuer.wants_refresh(kid):
                    await self._run(self.issuer.refresh)
        if not self.issuer.available:
            return await self._reviewed(token, key)
        sender = self.issuer.verify(token, self.settings.progress_audience)
        self.verified.put(key, sender)
        return sender

    async def _reviewed(self, token: str, key: str) -> Sender:
        """A TokenReview's verdict, for an API server that publishes no issuer keys: junk refused first, and
        reviews rate-limited for everyone."""
        precheck(token, self.settings.progress_audience, self.wall())
        known = self.reviews.get(key)
        if known is None:
            if not self.review_budget.take():
                raise Refusal(429, "too many tokens to verify; try again")
            review = await self._run(self.kube.token_review, token, self.settings.progress_audience)
            try:
                known = sender_from_review(review, self.settings.progress_audience)
            except Refusal as r:
                known = r
            self.reviews.put(key, known)
        if isinstance(known, Refusal):
            raise known
        return known

    def _limit(self, sender: Sender) -> None:
        now, rate = self.clock(), self.settings.reports_per_second
        _, bucket = self.per_pod.get(sender.pod_uid) or (now, Bucket(rate, rate * 5, self.clock))
        self.per_pod[sender.pod_uid] = (now, bucket)
        if not bucket.take():
            raise Refusal(429, "reports come too fast: at most progressReportsPerSecond per pod")

    async def _accept(self, report: ProgressReport) -> dict[str, Any]:
        desk = self.jobs.setdefault(report.uid, JobDesk())
        desk.report, desk.touched = report, self.clock()
        cursor = desk.cursor
        ack = cursor[2] if cursor and cursor[:2] == (report.attempt, report.run) else 0
        # Progress waits for its interval; what happened (a trainer event) and the last step do not. Both are
        # bounded: events by the checkpoint interval, every report by the per-pod rate limit.
        urgent = any(e.seq > ack for e in report.events) or report.step == report.total_steps
        written = False
        if urgent or self.clock() - desk.written_at >= self.settings.progress_write_seconds:
            written = await self.write(report.uid)
            cursor = desk.cursor
            ack = cursor[2] if cursor and cursor[:2] == (report.attempt, report.run) else 0
        return {"acknowledged": ack, "written": written}

    async def write(self, uid: str) -> bool:
        """Merge the job's newest accepted report into its status; its events become Kubernetes events."""
        desk = self.jobs.get(uid)
        if desk is None:
            return False
        desk.lock = desk.lock or asyncio.Lock()
        async with desk.lock:
            report = desk.report
            if report is None:
                return False
            job = self.cached(report.namespace, report.name)
            for _ in range(5):  # the job changes under us (reconcile writes its status): read it, merge again
                if job is None or job["metadata"]["uid"] != report.uid:
                    job = await self._run(self.kube.get_job, report.namespace, report.name)
                if job is None or job["metadata"]["uid"] != report.uid:
                    desk.report = None  # every report of this UID is refused from now on
                    raise Refusal(403, f"job {report.namespace}/{report.name} with UID {report.uid} is gone")
                status = ShardedTrainingJobStatus.model_validate(job.get("status") or {})
                try:
                    fields, events = merge_report(status, report, iso())
                except Refusal:
                    if desk.report is report:  # a newer one taken meanwhile is judged on its own
                        desk.report = None
                    raise
                if not fields:  # superseded by what status holds: nothing to write
                    break
                rv = job["metadata"]["resourceVersion"]
                if await self._run(self.kube.patch_report, report.namespace, report.name, fields, rv):
                    break
                job = None
            else:
                return False
            # A report taken while this one was being written is newer: it stays for the next write.
            if desk.report is report:
                desk.report = None
            desk.written_at = self.clock()
            written = ShardedTrainingJobStatus.model_validate({**(job.get("status") or {}), **fields})
            self.metrics.jobs.update(report.uid, report.namespace, report.name, written)
            desk.cursor = (report.attempt, report.run, acknowledged(written, report))
            for type_, reason, message in events:
                await self._run(self.kube.event, job, type_, reason, message)
        return True

    async def flush(self) -> None:
        """Write reports whose interval has passed, and drop state of jobs and pods gone quiet."""
        now = self.clock()
        self.failing = False  # a failed write leaves its report pending: the next flush tries it again
        for uid, desk in list(self.jobs.items()):
            if desk.report is not None and now - desk.written_at >= self.settings.progress_write_seconds:
                try:
                    await self.write(uid)
                except Refusal as r:
                    logger.info("report for job %s dropped: %s", uid, r.reason)
                except Exception:  # the API server away: the next flush tries again
                    logger.exception("writing a progress report for job %s failed", uid)
                    self.failing = True
            elif desk.report is None and now - desk.touched > IDLE_SECONDS:
                del self.jobs[uid]
        for pod_uid, (used, _) in list(self.per_pod.items()):
            if now - used > IDLE_SECONDS:
                del self.per_pod[pod_uid]

    async def run_flusher(self, interval: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.flush()
