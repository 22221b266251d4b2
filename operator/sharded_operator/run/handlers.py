"""Thin kopf handlers over a watched view of the cluster, a work queue and reconcile().

kopf's indexes hold what the watches delivered: every job and every pod with a job's name label (the pod
watch is label-selected by the API server, not filtered here) reduced to what decisions read; every
node's readiness comes from the operator's own node watch (`nodewatch`: node heartbeats never reach kopf).
kopf runs no handler before each index has had its initial listing, and no worker starts before the
nodes are listed, so no job is judged on a partial view. Handlers only mark a job to look at; a fixed
number of workers reconcile marked jobs, never one job twice at once, each from a snapshot of the
indexes: a reconcile at rest reads nothing from the API server. A decision that depends on the clock
schedules the job's next look itself (`status.next_due`); the resync loop is a slow safety net for
unfinished jobs, never for finished ones.

The resync is one loop of the operator's, not a kopf timer per job: kopf puts a finalizer on every
object a timer watches, and `kubectl delete stj` would then hang while the operator is down. Every
replica watches, serves progress reports and writes them into status; only the Lease holder reconciles
(`election`), and a change of only the fields progress reports write does not cause a reconcile.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf

from sharded_operator.api.models import GROUP, LABEL_JOB, PLURAL, VERSION
from sharded_operator.api.status import FINISHED
from sharded_operator.decide.progress import REPORT_FIELDS
from sharded_operator.decide.views import JobView, PodView
from sharded_operator.run import election, transport, web
from sharded_operator.run.intake import PROGRESS_THREADS, ProgressDesk
from sharded_operator.run.k8s import Kube
from sharded_operator.run.memory import TRIM_SECONDS, Trimmer
from sharded_operator.run.nodewatch import Changes, Gone, NodeWatch
from sharded_operator.run.reconcile import Context, Snapshot, reconcile
from sharded_operator.run.watched import JobKey, NoDiffBase, job_body, snapshot
from sharded_operator.run.workqueue import WorkQueue
from sharded_operator.settings import OperatorSettings

# Read once at import: `__main__` needs them before kopf starts.
SETTINGS = OperatorSettings.from_env()
# A reconcile that raised is retried after this many seconds, doubling per failure in a row up to the last.
RETRY_SECONDS = (1.0, 60.0)
# Threads of the event loop's default executor, which sends the lease's and the progress desk's requests
# (token reviews, pod reads, status writes). Set rather than left to Python (CPUs + 4, up to 32: the
# machine's CPUs, not the pod's) so that the connection pool can be sized to match.
API_THREADS = 16


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


# --- the watched view: kopf indexes ------------------------------------------------------------------
# Coroutines, so kopf runs them on its loop: no thread hop per event, and a snapshot (taken on the loop)
# never sees an index half updated.


@kopf.index(GROUP, VERSION, PLURAL)
async def jobs(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[JobKey, JobView] | None:
    return None if SETTINGS.ignores(namespace) else {(namespace, name): JobView.from_job(dict(body))}


@kopf.index("v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
async def job_pods(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[JobKey, PodView] | None:
    return None if SETTINGS.ignores(namespace) else {(namespace, labels[LABEL_JOB]): PodView.from_pod(dict(body))}


@kopf.index("v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
async def node_jobs(namespace: str, labels: kopf.Labels, spec: kopf.Spec, **_: Any) -> dict[str, JobKey] | None:
    """The jobs with a pod on each node: those to look at when the node's readiness changes."""
    node = spec.get("nodeName")
    return {node: (namespace, labels[LABEL_JOB])} if node and not SETTINGS.ignores(namespace) else None


# --- the loops ---------------------------------------------------------------------------------------


async def work(ctx: Context, queue: WorkQueue, index: kopf.Memo, pool: ThreadPoolExecutor, looks: Looks,
               logger: logging.Logger) -> None:  # fmt: skip
    """One worker: take a marked job, reconcile it from a snapshot, schedule its next look if the clock
    can change its decision. A reconcile that raised is retried with backoff (its events retry it too)."""
    loop = asyncio.get_running_loop()
    await ctx.indexed.wait()
    await ctx.nodes_listed.wait()
    while True:
        key = await queue.get()
        try:
            snap = snapshot(ctx, index, key) if ctx.leadership.leading(_now()) else None
            if snap is None:
                continue
            if looks.unchanged(key, snap, _now()):
                ctx.metrics.looks_skipped.inc()
                # Its timer may have fired a little early (the queue's clock is monotonic, due times are
                # the wall's): keep it armed.
                if (due := looks.due(key)) is not None:
                    queue.add_after(key, max((due - _now()).total_seconds(), 0.05))
                continue
            out = await loop.run_in_executor(pool, reconcile, ctx, snap, logger)
            looks.done(key, snap, out.due if out else None)
            if out is not None and out.due is not None:
                queue.add_after(key, (out.due - _now()).total_seconds())
        except Exception:  # one job's trouble must not stop the others
            delay = looks.failed(key)
            logger.exception("reconcile of %s/%s failed; again in %.0fs", *key, delay)
            queue.add_after(key, delay)
        finally:
            queue.done(key)


class Looks:
    """What each job's last reconcile saw, so a look at an unchanged job before its due time (a pod event
    that changes nothing a decision reads: a label, a heartbeat) costs a comparison, not a reconcile; and
    each job's failures in a row, for the backoff. The resync forces a real look."""

    def __init__(self) -> None:
        self.last: dict[JobKey, tuple[Snapshot, dt.datetime | None]] = {}
        self.forced: set[JobKey] = set()
        self.failures: dict[JobKey, int] = {}

    def unchanged(self, key: JobKey, snap: Snapshot, now: dt.datetime) -> bool:
        if key in self.forced:
            self.forced.discard(key)
            return False
        last = self.last.get(key)
        return last is not None and last[0] == snap and (last[1] is None or now < last[1])

    def due(self, key: JobKey) -> dt.datetime | None:
        last = self.last.get(key)
        return last[1] if last else None

    def done(self, key: JobKey, snap: Snapshot, due: dt.datetime | None) -> None:
        self.failures.pop(key, None)
        self.last[key] = (snap, due)

    def failed(self, key: JobKey) -> float:
        """Seconds until the retry: doubling per failure in a row, up to the last of RETRY_SECONDS."""
        self.last.pop(key, None)
        self.failures[key] = n = self.failures.get(key, 0) + 1
        return min(RETRY_SECONDS[0] * 2 ** (n - 1), RETRY_SECONDS[1])

    def forget(self, key: JobKey) -> None:
        self.last.pop(key, None)
        self.forced.discard(key)
        self.failures.pop(key, None)


async def resync(ctx: Context, queue: WorkQueue, index: kopf.Memo, looks: Looks, interval: float) -> None:
    """The safety net: every unfinished job is reconciled every `interval` seconds, whatever the events."""
    while True:
        await asyncio.sleep(interval)
        ctx.health.beat("resync")
        if not ctx.leadership.leading(_now()):
            continue
        for key, store in list(index.jobs.items()):
            if any(j.phase not in FINISHED for j in store):
                looks.forced.add(key)
                queue.add(key)


async def elect(ctx: Context, queue: WorkQueue, index: kopf.Memo, looks: Looks, logger: logging.Logger) -> None:
    """Acquire or renew the Lease every few seconds; on becoming the holder, look at every job. On a thread
    and a connection of its own, with short timeouts: no reconcile, progress report or token renewal of the
    other threads can hold a renewal up."""
    cfg, loop = ctx.settings, asyncio.get_running_loop()
    kube = Kube.connect(connections=1, timeout=election.REQUEST_SECONDS, agent=f"sharded-operator/{cfg.identity}")
    pool, seen = ThreadPoolExecutor(1, thread_name_prefix="lease"), election.Observed()
    while True:
        ctx.health.beat("election")
        was, started = ctx.leadership.leading(_now()), _now()
        try:
            held = await loop.run_in_executor(
                pool, kube.lease, cfg.lease_namespace, cfg.lease_name,
                lambda spec: election.claim(spec, cfg.identity, _now(), seen, time.monotonic()),
            )  # fmt: skip
        except Exception:  # the API server away: keep acting only until the renew deadline
            logger.exception("renewing the Lease failed")
            held = False
        ctx.leadership.record(held, started, _now())
        if (leading := ctx.leadership.leading(_now())) != was:
            logger.warning("%s the Lease %s", "holding" if leading else "lost", cfg.lease_name)
            # Another replica wrote meanwhile, or writes from now on: only what the watch shows is believed.
            ctx.recent.clear()
            ctx.seen.clear()
            looks.last.clear()
            if leading:
                ctx.hearing.hearing(_now())
                for key in list(index.jobs):
                    queue.add(key)
            else:
                ctx.hearing.deaf()
        await asyncio.sleep(election.RETRY_SECONDS)


async def trim_memory(queue: WorkQueue, trimmer: Trimmer, logger: logging.Logger) -> None:
    """Every TRIM_SECONDS, while no job waits for a reconcile, give the memory freed since back (memory.py)."""
    while True:
        await asyncio.sleep(TRIM_SECONDS)
        if len(queue) == 0 and (freed := trimmer.trim() or 0) >= 2**20:  # less is not news
            logger.info("gave %.1f MB of freed memory back to the system", freed / 2**20)


async def flush_progress(desk: ProgressDesk, ctx: Context) -> None:
    while True:
        await asyncio.sleep(1)
        ctx.health.beat("progress")
        await desk.flush()
        # Reports that cannot be written leave status behind what the pods said: no silence is proven then.
        if desk.failing or not ctx.leadership.leading(_now()):
            ctx.hearing.deaf()
        else:
            ctx.hearing.hearing(_now())


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf's watches connect with the credentials of the operator's own requests (transport.load); kopf's
    built-in login would load the `kubernetes` package for it. No expiration is given: when the API server
    refuses a token (rotated by the kubelet, an exec plugin's expired), kopf logs in again, which reads it
    anew, rather than reopening its watches each minute."""
    c = transport.load()
    return kopf.ConnectionInfo(
        server=c.server, ca_data=c.ca, insecure=c.insecure, certificate_data=c.cert, private_key_data=c.key,
        token=c.token, username=c.username, password=c.password, proxy_url=c.proxy, default_namespace=c.namespace,
    )  # fmt: skip


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, jobs: kopf.Index,
                  job_pods: kopf.Index, node_jobs: kopf.Index, **_: Any) -> None:  # fmt: skip
    cfg = SETTINGS
    settings.posting.level = logging.WARNING  # our own events are richer than kopf's per-handler ones
    # Handlers only queue jobs: a line per handled event would cost more than the handling (thousands of pod
    # events a minute in a large cluster). kopf's warnings and errors still show.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.watching.server_timeout = 300
    # Only pods with a job's name label reach the operator: the API server selects them.
    settings.watching.label_selectors["v1", "pods"] = LABEL_JOB
    settings.peering.standalone = True
    metrics = web.Metrics(cfg.metrics_max_jobs)
    # A connection for each thread that may send at once: the reconcilers, their creators (twice as many),
    # the node watch, the loop's default executor, and the progress work's threads (the Lease has its own).
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(API_THREADS, thread_name_prefix="api"))
    kube = Kube.connect(on_request=lambda method, resource: metrics.api_requests.labels(method, resource).inc(),
                        connections=3 * cfg.reconcile_workers + 1 + API_THREADS + PROGRESS_THREADS,
                        agent=f"sharded-operator/{cfg.identity}")  # fmt: skip
    ctx = memo.ctx = Context(settings=cfg, kube=kube, metrics=metrics)
    ctx.leadership = election.Leadership(cfg.identity, enabled=bool(cfg.lease_name), clock=_now)
    ctx.health = web.Health(cfg.stuck_seconds)
    ctx.indexed, ctx.nodes_listed = asyncio.Event(), asyncio.Event()
    # Nodes by name (NodeView), kept by the node watch: nodes are not watched through kopf (see nodewatch);
    # and the names the watch has seen deleted (a fact, unlike a name that was never listed).
    memo.index = index = kopf.Memo(jobs=jobs, job_pods=job_pods, node_jobs=node_jobs, nodes={},
                                   nodes_gone=Gone())  # fmt: skip
    memo.queue = queue = WorkQueue()
    ctx.metrics.watch_queue(queue)
    pool = ThreadPoolExecutor(cfg.reconcile_workers, thread_name_prefix="reconcile")
    ctx.creators = ThreadPoolExecutor(2 * cfg.reconcile_workers, thread_name_prefix="create")
    memo.looks = looks = Looks()
    desk = ProgressDesk(ctx.kube, cfg, ctx.metrics, cached=lambda ns, name: job_body(jobs, (ns, name)))
    memo.runners = [
        await web.start(web.metrics_app(ctx.metrics, ctx.health), cfg.http_host, cfg.http_port),
        await web.start(
            web.progress_app(desk.take, guard=(guard := web.ConnectionGuard())), cfg.http_host, cfg.progress_port, guard
        ),
    ]
    memo.tasks = [
        asyncio.create_task(resync(ctx, queue, memo.index, looks, cfg.resync_seconds)),
        asyncio.create_task(flush_progress(desk, ctx)),
        *(asyncio.create_task(work(ctx, queue, memo.index, pool, looks, logger)) for _ in range(cfg.reconcile_workers)),
    ]
    if cfg.lease_name:
        memo.tasks.append(asyncio.create_task(elect(ctx, queue, memo.index, looks, logger)))
    if (trimmer := Trimmer()).available:
        memo.tasks.append(asyncio.create_task(trim_memory(queue, trimmer, logger)))
    loop = asyncio.get_running_loop()

    def on_nodes(diff: Changes) -> None:  # on the watch's thread
        loop.call_soon_threadsafe(nodes_changed, ctx, queue, index, diff)

    memo.node_watch = NodeWatch(
        kube, on_listed=on_nodes, on_change=lambda name, view: on_nodes({name: view}),
        on_event=metrics.watch_events.labels("nodes").inc,
    )  # fmt: skip
    memo.node_watch.start()
    logger.info("serving /metrics and /healthz on %s:%s, /progress on port %s", cfg.http_host, cfg.http_port,
                cfg.progress_port)  # fmt: skip


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    if (watch := getattr(memo, "node_watch", None)) is not None:
        watch.stop.set()
    for task in getattr(memo, "tasks", []):
        task.cancel()
    for runner in getattr(memo, "runners", []):
        await runner.cleanup()


# What of a progress report a decision reads without a timer: a new trainer process (an in-place recovery
# ends when one reports) and the size of its rendezvous round (status.currentNodes). The step, loss and
# report times change every write and are read by timers (hang) or not at all.
PROGRESS_DECIDES = ("attempt", "run", "nodes")


def _digest(body: kopf.Body | dict[str, Any]) -> str:
    """The job as reconcile sees it: without its version and what progress reports write but no decision
    reads."""
    meta = {k: v for k, v in body.get("metadata", {}).items() if k not in ("resourceVersion", "managedFields")}
    status = {k: v for k, v in (body.get("status") or {}).items() if k not in REPORT_FIELDS}
    progress = (body.get("status") or {}).get("progress") or {}
    status["progress"] = {k: progress.get(k) for k in PROGRESS_DECIDES}
    return hashlib.sha256(json.dumps([meta, body.get("spec"), status], sort_keys=True).encode()).hexdigest()


# --- events: each only marks a job to look at --------------------------------------------------------


@kopf.on.event(GROUP, VERSION, PLURAL)
async def job_event(type: str, body: kopf.Body, name: str, namespace: str, uid: str, memo: kopf.Memo,
                    **_: Any) -> None:  # fmt: skip
    ctx: Context = memo.ctx
    ctx.indexed.set()  # kopf runs handlers only once every index is listed
    ctx.metrics.watch_events.labels("jobs").inc()
    if ctx.settings.ignores(namespace):
        return
    if type == "DELETED":
        ctx.forget(uid, namespace, name)
        memo.queue.forget((namespace, name))
        memo.looks.forget((namespace, name))
        return
    digest = _digest(body)
    if ctx.seen.get(uid) == digest or not ctx.leadership.leading(_now()):
        return  # a progress write only, or not ours to act on
    ctx.seen[uid] = digest
    memo.queue.add((namespace, name))


@kopf.on.event("v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
async def pod_event(type: str, body: kopf.Body, labels: kopf.Labels, namespace: str, memo: kopf.Memo,
                    **_: Any) -> None:  # fmt: skip
    ctx: Context = memo.ctx
    ctx.indexed.set()
    ctx.metrics.watch_events.labels("pods").inc()
    if ctx.settings.ignores(namespace):
        return
    if type == "DELETED":  # its last state says why it went; the index forgets it
        ctx.pod_gone(namespace, labels[LABEL_JOB], dict(body))
    if ctx.leadership.leading(_now()):
        memo.queue.add((namespace, labels[LABEL_JOB]))


def nodes_changed(ctx: Context, queue: WorkQueue, index: kopf.Memo, diff: Changes) -> None:
    """On the loop, from the node watch: a node's readiness changed, or the node went (or came): the view
    snapshots read follows, and the jobs with a pod on the node are looked at."""
    for name, view in diff.items():
        if view is None:
            index.nodes.pop(name, None)
            index.nodes_gone.add(name)
        else:
            index.nodes[name] = view
            index.nodes_gone.discard(name)
    ctx.nodes_listed.set()
    if ctx.leadership.leading(_now()):
        for key in {key for name in diff for key in index.node_jobs.get(name, ())}:
            queue.add(key)
