"""Thin kopf handlers: every event about a job or one of its pods, and a resync timer, call reconcile()."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from sharded_operator import web
from sharded_operator.k8s import Kube
from sharded_operator.models import GROUP, LABEL_JOB, PLURAL, VERSION
from sharded_operator.reconcile import Context, reconcile
from sharded_operator.settings import OperatorSettings

# Read once at import: kopf needs the timer interval when the decorator runs.
SETTINGS = OperatorSettings.from_env()


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
    logger.info("serving /metrics, /healthz and /progress on %s:%s", cfg.http_host, cfg.http_port)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    if getattr(memo, "runner", None):
        await memo.runner.cleanup()


@kopf.on.event(GROUP, VERSION, PLURAL)
def job_event(type: str, name: str, namespace: str, uid: str, memo: kopf.Memo, logger, **_: Any) -> None:
    if type == "DELETED":
        memo.ctx.forget(uid, namespace, name)
        return
    reconcile(memo.ctx, namespace, name, logger)


@kopf.on.event("v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
def pod_event(
    type: str, body: kopf.Body, labels: dict[str, str], namespace: str, memo: kopf.Memo, logger, **_: Any
) -> None:
    if type == "DELETED":  # its last state says why it went; the next list will not have it
        memo.ctx.pod_gone(namespace, labels[LABEL_JOB], dict(body))
    reconcile(memo.ctx, namespace, labels[LABEL_JOB], logger)


@kopf.timer(GROUP, VERSION, PLURAL, interval=SETTINGS.resync_seconds, idle=None)
def resync(name: str, namespace: str, memo: kopf.Memo, logger, **_: Any) -> None:
    """Level-based checks no event announces: hang timeout, deadlines, TTL, progress, lost nodes."""
    reconcile(memo.ctx, namespace, name, logger)
