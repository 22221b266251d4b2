"""Thin kopf handlers: every event about a job or one of its pods, and a resync loop, call reconcile().

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
from typing import Any

import kopf

from sharded_operator import election, web
from sharded_operator.intake import ProgressDesk
from sharded_operator.k8s import Kube
from sharded_operator.models import GROUP, LABEL_JOB, PLURAL, VERSION
from sharded_operator.progress import REPORT_FIELDS
from sharded_operator.reconcile import Context, reconcile
from sharded_operator.settings import OperatorSettings

# Read once at import: `__main__` needs them before kopf starts.
SETTINGS = OperatorSettings.from_env()


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


async def resync(ctx: Context, interval: float, logger: logging.Logger) -> None:
    """Level-based checks no event announces (hang timeout, deadlines, TTL, lost nodes), for every job
    seen, one after another in the executor kopf's sync handlers use."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval)
        ctx.health.beat("resync")
        if not ctx.leadership.leading(_now()):
            continue
        for namespace, name in sorted(ctx.known):
            try:
                if await loop.run_in_executor(None, reconcile, ctx, namespace, name, logger) is None:
                    ctx.known.discard((namespace, name))
            except Exception:  # one job's trouble must not stop the others' resync; its events retry it
                logger.exception("resync of %s/%s failed", namespace, name)


async def elect(ctx: Context, logger: logging.Logger) -> None:
    """Acquire or renew the Lease every few seconds; on becoming the holder, reconcile every known job."""
    cfg, loop = ctx.settings, asyncio.get_running_loop()
    while True:
        ctx.health.beat("election")
        was = ctx.leadership.leading(_now())
        try:
            held = await loop.run_in_executor(
                None, ctx.kube.lease, cfg.lease_namespace, cfg.lease_name,
                lambda spec: election.claim(spec, cfg.identity, _now()),
            )  # fmt: skip
        except Exception:  # the API server away: keep acting only until the renew deadline
            logger.exception("renewing the Lease failed")
            held = False
        ctx.leadership.record(held, _now())
        if ctx.leadership.leading(_now()) != was:
            logger.warning("%s the Lease %s", "holding" if not was else "lost", cfg.lease_name)
        await asyncio.sleep(election.RETRY_SECONDS)


async def flush_progress(desk: ProgressDesk, ctx: Context) -> None:
    while True:
        await asyncio.sleep(1)
        ctx.health.beat("progress")
        await desk.flush()


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    cfg = SETTINGS
    settings.posting.level = logging.WARNING  # our own events are richer than kopf's per-handler ones
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.watching.server_timeout = 300
    settings.peering.standalone = True
    ctx = memo.ctx = Context(settings=cfg, kube=Kube.connect(), metrics=web.Metrics(cfg.metrics_max_jobs))
    ctx.leadership = election.Leadership(cfg.identity, enabled=bool(cfg.lease_name))
    ctx.health = web.Health(cfg.stuck_seconds)
    desk = ProgressDesk(ctx.kube, cfg, ctx.metrics)
    memo.runners = [
        await web.start(web.metrics_app(ctx.metrics, ctx.health), cfg.http_host, cfg.http_port),
        await web.start(web.progress_app(desk.take), cfg.http_host, cfg.progress_port),
    ]
    memo.tasks = [asyncio.create_task(resync(ctx, cfg.resync_seconds, logger)),
                  asyncio.create_task(flush_progress(desk, ctx))]  # fmt: skip
    if cfg.lease_name:
        memo.tasks.append(asyncio.create_task(elect(ctx, logger)))
    logger.info("serving /metrics and /healthz on %s:%s, /progress on port %s", cfg.http_host, cfg.http_port,
                cfg.progress_port)  # fmt: skip


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    for task in getattr(memo, "tasks", []):
        task.cancel()
    for runner in getattr(memo, "runners", []):
        await runner.cleanup()


def _digest(body: kopf.Body) -> str:
    """The job as reconcile sees it: without its version and the fields progress reports write."""
    meta = {k: v for k, v in body.get("metadata", {}).items() if k not in ("resourceVersion", "managedFields")}
    status = {k: v for k, v in (body.get("status") or {}).items() if k not in REPORT_FIELDS}
    return hashlib.sha256(json.dumps([meta, body.get("spec"), status], sort_keys=True).encode()).hexdigest()


@kopf.on.event(GROUP, VERSION, PLURAL)
def job_event(type: str, body: kopf.Body, name: str, namespace: str, uid: str, memo: kopf.Memo, logger,
              **_: Any) -> None:  # fmt: skip
    ctx: Context = memo.ctx
    if ctx.settings.ignores(namespace):
        return
    if type == "DELETED":
        ctx.forget(uid, namespace, name)
        ctx.seen.pop(uid, None)
        return
    ctx.known.add((namespace, name))
    digest = _digest(body)
    if ctx.seen.get(uid) == digest or not ctx.leadership.leading(_now()):
        return  # a progress write only, or not ours to act on: the resync still looks
    ctx.seen[uid] = digest
    reconcile(ctx, namespace, name, logger)


@kopf.on.event("v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
def pod_event(
    type: str, body: kopf.Body, labels: dict[str, str], namespace: str, memo: kopf.Memo, logger, **_: Any
) -> None:
    ctx: Context = memo.ctx
    if ctx.settings.ignores(namespace):
        return
    if type == "DELETED":  # its last state says why it went; the next list will not have it
        ctx.pod_gone(namespace, labels[LABEL_JOB], dict(body))
    if ctx.leadership.leading(_now()):
        reconcile(ctx, namespace, labels[LABEL_JOB], logger)
