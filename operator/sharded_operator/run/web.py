"""The operator's HTTP endpoints: /metrics and /healthz on one port, POST /progress on another (what a
report is and who may send one: `intake`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sharded_api.contract import MAX_REPORT_BYTES
from sharded_operator.api.status import Phase
from sharded_operator.run.jobmetrics import JobSeries


class Metrics:
    """Counters and histograms of the operator, and each job's training metrics (`jobmetrics`), in their own
    registry (no process-global state)."""

    def __init__(self, max_jobs: int = 1000) -> None:
        self.registry = CollectorRegistry()
        self.jobs = JobSeries(max_jobs)
        self.registry.register(self.jobs)
        self.jobs_by_phase = Gauge("sharded_jobs", "ShardedTrainingJobs by phase", ["phase"], registry=self.registry)
        self.restarts = Counter("sharded_job_restarts_total", "Gang restarts", ["namespace"], registry=self.registry)
        self.failures = Counter(
            "sharded_job_failures_total", "Attempt failures by reason", ["reason"], registry=self.registry
        )
        self.finished = Counter(
            "sharded_jobs_finished_total", "Jobs that ended, by phase", ["phase"], registry=self.registry
        )
        self.api_requests = Counter(
            "sharded_api_requests", "Requests the operator sent to the API server (watches apart), by method and "
            "resource", ["method", "resource"], registry=self.registry,
        )  # fmt: skip
        self.watch_events = Counter(
            "sharded_watch_events", "Watch events handled, by kind (jobs, pods, nodes)", ["kind"],
            registry=self.registry,
        )  # fmt: skip
        self.looks_skipped = Counter(
            "sharded_reconcile_skipped", "Looks at a job whose snapshot had not changed since its last reconcile",
            registry=self.registry,
        )  # fmt: skip
        self.pods_created = Counter("sharded_pods_created_total", "Pods created", registry=self.registry)
        self.stale_writes = Counter(
            "sharded_stale_decisions", "Status writes refused because the job changed since it was read; decided anew",
            registry=self.registry,
        )  # fmt: skip
        self.reconcile_seconds = Histogram(
            "sharded_reconcile_duration_seconds",
            "Time of one reconcile of one job",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.progress_reports = Counter(
            "sharded_progress_reports_total", "Progress reports by answer (HTTP status)", ["code"],
            registry=self.registry,
        )  # fmt: skip
        self.queued = Gauge("sharded_reconcile_queue_depth", "Jobs waiting for a reconcile worker",
                            registry=self.registry)  # fmt: skip
        self.scheduled = Gauge("sharded_reconcile_scheduled", "Jobs with a timed next look (deadline, timeout)",
                               registry=self.registry)  # fmt: skip
        self._phases: dict[str, str] = {}
        for p in Phase:
            self.jobs_by_phase.labels(p.value).set(0)

    def watch_queue(self, queue: Any) -> None:
        """Read the work queue's depth and timers at each scrape (a WorkQueue: len() and .scheduled)."""
        self.queued.set_function(lambda: len(queue))
        self.scheduled.set_function(lambda: queue.scheduled)

    def observe_phase(self, uid: str, phase: str | None) -> None:
        """O(1): the job leaves its old phase's count and joins the new one's."""
        old = self._phases.pop(uid, None) if phase is None else self._phases.get(uid)
        if old == phase:
            return
        if old is not None:
            self.jobs_by_phase.labels(old).dec()
        if phase is not None:
            self._phases[uid] = phase
            self.jobs_by_phase.labels(phase).inc()


class Health:
    """Liveness: the operator's loops say they are alive; /healthz fails once one has been silent too long."""

    def __init__(self, limit: float, clock: Callable[[], float] = time.monotonic):
        self.limit, self.clock = limit, clock
        self.beats: dict[str, float] = {}

    def beat(self, loop: str) -> None:
        self.beats[loop] = self.clock()

    def stale(self) -> list[str]:
        now = self.clock()
        return sorted(name for name, at in self.beats.items() if now - at > self.limit)


def metrics_app(metrics: Metrics, health: Health) -> web.Application:
    async def get_metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        if stale := health.stale():
            return web.Response(status=503, text=f"stuck: {', '.join(stale)}")
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/healthz", healthz)
    return app


# A report is a few KB sent at once by a trainer on the cluster network: seconds are generous, and a peer that
# takes longer is holding a connection, not reporting.
HEADER_SECONDS = 10.0
BODY_SECONDS = 10.0
MAX_CONNECTIONS = 512


def progress_app(
    take: Callable[[str | None, bytes], Awaitable[tuple[int, dict[str, Any]]]],
    body_seconds: float = BODY_SECONDS,
    guard: ConnectionGuard | None = None,
) -> web.Application:
    """POST /progress: `take(Authorization header, body)` answers (HTTP status, JSON body).

    The whole body is read, however many TCP segments it comes in, up to the report limit and within
    `body_seconds`; one request per connection (a trainer posts every few seconds), so `guard`'s deadline
    for the request's headers covers every connection.
    """

    async def post_progress(request: web.Request) -> web.Response:
        if guard is not None:
            guard.started(request.transport)
        try:
            body = await asyncio.wait_for(request.read(), body_seconds)
        except web.HTTPRequestEntityTooLarge:
            status, answer = 413, {"error": f"a report is at most {MAX_REPORT_BYTES} bytes"}
        except TimeoutError:
            status, answer = 408, {"error": f"the report's body did not arrive within {body_seconds:g} s"}
        else:
            status, answer = await take(request.headers.get("Authorization"), body)
        response = web.json_response(answer, status=status)
        response.force_close()
        return response

    app = web.Application(client_max_size=MAX_REPORT_BYTES)
    app.router.add_post("/progress", post_progress)
    return app


class ConnectionGuard:
    """Wraps a server's protocol factory: at most `limit` connections open at once (more are closed as they
    arrive), and a connection whose request headers have not all arrived within `header_seconds` is closed,
    so half-sent requests cannot hold the server's sockets."""

    def __init__(self, limit: int = MAX_CONNECTIONS, header_seconds: float = HEADER_SECONDS):
        self.limit, self.header_seconds = limit, header_seconds
        self.factory: Callable[[], asyncio.Protocol] | None = None
        self.open: dict[asyncio.BaseTransport, asyncio.TimerHandle | None] = {}
        self.refused = 0
        self.port = 0  # the port it listens on, once started

    def __call__(self) -> asyncio.Protocol:
        assert self.factory is not None
        return _Guarded(self, self.factory())

    def opened(self, transport: asyncio.BaseTransport) -> bool:
        if len(self.open) >= self.limit:
            self.refused += 1
            return False
        loop = asyncio.get_running_loop()
        self.open[transport] = loop.call_later(self.header_seconds, transport.abort)  # type: ignore[attr-defined]
        return True

    def started(self, transport: asyncio.BaseTransport | None) -> None:
        """The request's headers are in: its body has a deadline of its own."""
        timer = self.open.get(transport) if transport is not None else None
        if timer is not None:
            timer.cancel()
            self.open[transport] = None

    def closed(self, transport: asyncio.BaseTransport | None) -> None:
        timer = self.open.pop(transport, None) if transport is not None else None
        if timer is not None:
            timer.cancel()


class _Guarded(asyncio.Protocol):
    """One connection's protocol (aiohttp's), with the guard told when it opens and closes."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol):
        self.guard, self.inner, self.transport = guard, inner, None

    def connection_made(self, transport):
        self.inner.connection_made(transport)
        if self.guard.opened(transport):
            self.transport = transport
        else:
            transport.abort()

    def connection_lost(self, exc):
        self.guard.closed(self.transport)
        self.inner.connection_lost(exc)

    def data_received(self, data):
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def pause_writing(self):
        self.inner.pause_writing()

    def resume_writing(self):
        self.inner.resume_writing()


async def start(app: web.Application, host: str, port: int, guard: ConnectionGuard | None = None) -> web.AppRunner:
    """Serve `app` on host:port; with `guard`, through its connection limits (runner.cleanup() closes it too)."""
    servers: list[asyncio.Server] = []

    async def close(_: web.Application) -> None:
        for server in servers:
            server.close()
            await server.wait_closed()

    app.on_cleanup.append(close)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    if guard is None:
        await web.TCPSite(runner, host, port).start()
    else:
        guard.factory = runner.server
        servers.append(server := await asyncio.get_running_loop().create_server(guard, host, port))
        guard.port = server.sockets[0].getsockname()[1]
    return runner
