"""The watched view a reconcile decides on: one job from kopf's indexes, with this operator's own writes the
watch has not shown yet, and kopf's diff base left empty (no handler here reads a diff)."""

from __future__ import annotations

from typing import Any

import kopf

from sharded_operator.api.status import FINISHED
from sharded_operator.decide.views import JobView
from sharded_operator.run.reconcile import Context, Snapshot, owned

JobKey = tuple[str, str]  # (namespace, name)


def job_body(index: kopf.Index, key: JobKey) -> dict[str, Any] | None:
    """The job as the watch last showed it (the one not being deleted, if two share the name)."""
    views: list[JobView] = list(index.get(key, ()))
    return next((v for v in views if not v.deleting), views[0]).body() if views else None


def snapshot(ctx: Context, index: kopf.Memo, key: JobKey) -> Snapshot | None:
    """The job `key` as the indexes show it, with this operator's writes the watch has not shown yet."""
    body = job_body(index.jobs, key)
    if body is None:
        return None
    uid = body["metadata"]["uid"]
    status = ctx.recent.status(uid, body.get("status") or {}, owned)
    # The version a decision is written over: that of this operator's own status write while the watch lags.
    meta = {**body["metadata"], "resourceVersion": ctx.recent.version(uid, body["metadata"].get("resourceVersion"))}
    body = {**body, "metadata": meta, "status": status}
    pods = ctx.recent.pods(f"{key[0]}/{key[1]}", list(index.job_pods.get(key, ())))
    on = {p.node for p in pods if p.node}
    nodes = {n: v for n in on if (v := index.nodes.get(n)) is not None}
    # A node neither listed nor seen deleted may be one the watch has not reported yet (a backoff, a relist,
    # a dead connection not noticed): reconcile asks the API server before anything is declared lost.
    unconfirmed = frozenset(n for n in on if n not in nodes and n not in index.nodes_gone)
    ports: frozenset[int] = frozenset()
    if ((body.get("spec") or {}).get("network") or {}).get("hostNetwork") and "hostPort" not in body["status"]:
        ports = frozenset(
            j.host_port for store in index.jobs.values() for j in store
            if j.host_port is not None and j.phase not in FINISHED
        )  # fmt: skip
    return Snapshot(body=body, pods=pods, nodes=nodes, host_ports=ports, unconfirmed=unconfirmed)


class NoDiffBase(kopf.DiffBaseStorage):
    """No last-handled state. kopf builds one for every event of every watched object (a deep copy of the
    body, status included) to give on.create/on.update handlers their diffs; this operator has none (its
    handlers are events and indexes), and the copies were about a fifth of its busy time while 300 jobs
    started at once (bench/results/operator-scale/operator-scale-profile)."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return kopf.BodyEssence()

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        pass
