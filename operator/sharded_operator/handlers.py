"""Thin kopf handlers: every event about a job or one of its pods, and a resync loop, call reconcile().

The resync is one loop of the operator's, not a kopf timer per job: kopf puts a finalizer on every
object a timer watches, and `kubectl delete stj` would then hang while the operator is down.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from sharded_operator import web
from sharded_operator.k8s import Kube
from sharded_operator.models import GROUP, LABEL_JOB, PLURAL, VERSION
from sharded_operator.reconcile import Context, reconcile
from sharded_operator.settings import OperatorSettings

# Read once at import: `__main__` needs them before kopf starts.
SETTINGS = OperatorSettings.from_env()


async def resync(ctx: Context, interval: float, logger: logging.Logger) -> None:
    """Level-based checks no event announces (hang timeout, deadlines, TTL, progress, lost nodes), for
    every job seen, one after another in the executor kopf's sync handlers use."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval)
        for namespace, name in sorted(ctx.known):
            try:
                if await loop.run_in_executor(None, reconcile, ctx, namespace, name, logger) is None:
                    ctx.known.discard((namespace, name))
            except Exception:  # one job's trouble must not stop the others' resync; its events retry it
                logger.exception("resync of %s/%s failed", namespace, name)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    cfg = SETTINGS
    settings.posting.level = logging.WARNING  # our own events are richer than kopf's per-handler ones
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.watching.server_timeout = 300
    if cfg.peering:
        settings.peering.name = cfg.peering
        settings.peering.mandatory = True
    else:
        settings.peering.standalone = True
    memo.ctx = Context(settings=cfg, kube=Kube.connect())
    memo.runner = await web.start(web.make_app(memo.ctx.metrics, memo.ctx.progress), cfg.http_host, cfg.http_port)
    memo.resync = asyncio.create_task(resync(memo.ctx, cfg.resync_seconds, logger))
    logger.info("serving /metrics, /healthz and /progress on %s:%s", cfg.http_host, cfg.http_port)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    if getattr(memo, "resync", None):
        memo.resync.cancel()
    if getattr(memo, "runner", None):
        await memo.runner.cleanup()


@kopf.on.event(GROUP, VERSION, PLURAL)
def job_event(type: str, name: str, namespace: str, uid: str, memo: kopf.Memo, logger, **_: Any) -> None:
    if type == "DELETED":
        memo.ctx.forget(uid, namespace, name)
        return
    memo.ctx.known.add((namespace, name))
    reconcile(memo.ctx, namespace, name, logger)


@kopf.on.event("v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
def pod_event(
    type: str, body: kopf.Body, labels: dict[str, str], namespace: str, memo: kopf.Memo, logger, **_: Any
) -> None:
    if type == "DELETED":  # its last state says why it went; the next list will not have it
        memo.ctx.pod_gone(namespace, labels[LABEL_JOB], dict(body))
    reconcile(memo.ctx, namespace, labels[LABEL_JOB], logger)

