"""The operator's HTTP endpoint: Prometheus /metrics, /healthz, and POST /progress from rank 0 of each job.

A progress report is a `contract.ProgressReport`, validated here with the model the trainer wrote it
with: a body that is not one (wrong types, unknown keys, out-of-range numbers, another contract
version) is refused with 400 and the reason. Reports carry the job's UID, which a pod learns from its
own environment; knowing the UID is the capability to report for that job, so training pods need no
RBAC rights at all.
"""

from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import ValidationError

from sharded_operator.models import Phase
from sharded_trainer.config import format_validation_error
from sharded_trainer.contract import ProgressReport

MAX_TRACKED_JOBS = 10_000


class Metrics:
    """Counters and histograms of the operator, in their own registry (no process-global state)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.jobs_by_phase = Gauge("sharded_jobs", "ShardedTrainingJobs by phase", ["phase"], registry=self.registry)
        self.restarts = Counter("sharded_job_restarts_total", "Gang restarts", ["namespace"], registry=self.registry)
        self.failures = Counter(
            "sharded_job_failures_total", "Attempt failures by reason", ["reason"], registry=self.registry
        )
        self.finished = Counter(
            "sharded_jobs_finished_total", "Jobs that ended, by phase", ["phase"], registry=self.registry
        )
        self.pods_created = Counter("sharded_pods_created_total", "Pods created", registry=self.registry)
        self.reconcile_seconds = Histogram(
            "sharded_reconcile_duration_seconds",
            "Time of one reconcile of one job",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.progress_reports = Counter(
            "sharded_progress_reports_total", "Progress reports received", registry=self.registry
        )
        self._phases: dict[str, str] = {}

    def observe_phase(self, uid: str, phase: str | None) -> None:
        if phase is None:
            self._phases.pop(uid, None)
        else:
            self._phases[uid] = phase
        counts: dict[str, int] = {}
        for p in self._phases.values():
            counts[p] = counts.get(p, 0) + 1
        for p in Phase:
            self.jobs_by_phase.labels(p.value).set(counts.get(p, 0))


class ProgressStore:
    """The newest report per job UID."""

    def __init__(self) -> None:
        self.latest: dict[str, tuple[float, ProgressReport]] = {}

    def put(self, report: ProgressReport) -> None:
        if len(self.latest) >= MAX_TRACKED_JOBS and report.uid not in self.latest:
            oldest = min(self.latest, key=lambda k: self.latest[k][0])
            del self.latest[oldest]
        self.latest[report.uid] = (time.time(), report)

    def get(self, uid: str) -> ProgressReport | None:
        entry = self.latest.get(uid)
        return entry[1] if entry else None

    def forget(self, uid: str) -> None:
        self.latest.pop(uid, None)


def make_app(metrics: Metrics, progress: ProgressStore) -> web.Application:
    async def get_metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def post_progress(request: web.Request) -> web.Response:
        try:
            report = ProgressReport.model_validate_json(await request.read())
        except ValidationError as e:
            return web.json_response({"error": format_validation_error(e)}, status=400)
        progress.put(report)
        metrics.progress_reports.inc()
        return web.json_response({"ok": True})

    app = web.Application(client_max_size=64 * 1024)
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_post("/progress", post_progress)
    return app


async def start(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
