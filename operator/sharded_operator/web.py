"""The operator's HTTP endpoint: Prometheus /metrics, /healthz, and POST /progress from rank 0 of each job.

Progress reports carry the job's UID, which a pod learns from its own environment; knowing the UID is
the capability to report for that job, so training pods need no RBAC rights at all.
"""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
        for p in ("Pending", "Starting", "Running", "Restarting", "Succeeded", "Failed", "Suspended"):
            self.jobs_by_phase.labels(p).set(counts.get(p, 0))


class ProgressStore:
    """The newest report per job UID."""

    def __init__(self) -> None:
        self.latest: dict[str, dict[str, Any]] = {}

    def put(self, report: dict[str, Any]) -> None:
        if len(self.latest) >= MAX_TRACKED_JOBS and report["uid"] not in self.latest:
            oldest = min(self.latest, key=lambda k: self.latest[k]["receivedAt"])
            del self.latest[oldest]
        self.latest[report["uid"]] = {**report, "receivedAt": time.time()}

    def get(self, uid: str) -> dict[str, Any] | None:
        return self.latest.get(uid)

    def forget(self, uid: str) -> None:
        self.latest.pop(uid, None)


def make_app(metrics: Metrics, progress: ProgressStore) -> web.Application:
    async def get_metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def post_progress(request: web.Request) -> web.Response:
        try:
            report = json.loads(await request.read())
            if not isinstance(report, dict) or not isinstance(report.get("uid"), str) or "step" not in report:
                raise ValueError("a JSON object with uid and step is required")
            report["step"] = int(report["step"])
        except (ValueError, TypeError) as e:
            return web.json_response({"error": str(e)}, status=400)
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
