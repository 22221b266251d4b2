"""One reconcile of one job: read the world, decide (pure), apply the plan, write status once."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from sharded_api.contract import iso
from sharded_api.loading import format_validation_error
from sharded_operator.api.models import ShardedTrainingJob
from sharded_operator.api.overrides import forbidden
from sharded_operator.api.reasons import EventType, Reason
from sharded_operator.api.status import FINISHED, Phase, ShardedTrainingJobStatus
from sharded_operator.decide.due import next_due
from sharded_operator.decide.failure import missing_pods
from sharded_operator.decide.lifecycle import decide
from sharded_operator.decide.plan import record_refusal, set_phase
from sharded_operator.decide.progress import REPORT_FIELDS
from sharded_operator.decide.views import NodeView, Observed, PodView, controller_uid
from sharded_operator.render import children, names, podgroup, podspec, rendezvous
from sharded_operator.run.apicalls import MissingAPI, Refused, Stale
from sharded_operator.run.election import Hearing, Leadership
from sharded_operator.run.k8s import ApiError, Kube
from sharded_operator.run.recent import Recent
from sharded_operator.run.web import Health, Metrics
from sharded_operator.settings import OperatorSettings

# How soon a job whose pods could not be created looks again: a child's name held by a deleted job's object
# (its deletion is under way), or a create the API server refused (a quota, a policy: it may change).
HELD_SECONDS = 2
REFUSED_SECONDS = 10
# Decisions taken anew in one reconcile when the job keeps changing under them (progress reports land about
# once a second); past that the worker's backoff looks again.
STALE_RETRIES = 3


@dataclass
class Context:
    """What every reconcile shares: settings, the API, metrics, what pod events told, writes not yet watched."""

    settings: OperatorSettings
    kube: Kube
    metrics: Metrics = field(default_factory=Metrics)
    departed: dict[str, dict[str, PodView]] = field(default_factory=dict)  # "ns/job" -> pod name -> last view
    missing: dict[str, dict[str, str]] = field(default_factory=dict)  # "ns/job" -> pod name -> missing since
    unwatched: dict[str, set[str]] = field(default_factory=dict)  # "ns/job" -> pods missing at the first look
    seen: dict[str, str] = field(default_factory=dict)  # job UID -> digest of the version last reconciled on
    recent: Recent = field(default_factory=Recent)
    leadership: Leadership = field(default_factory=lambda: Leadership("", enabled=False))
    hearing: Hearing = field(default_factory=Hearing)
    health: Health = field(default_factory=lambda: Health(float("inf")))
    indexed: asyncio.Event | None = None  # set once every kind kopf watches has had its initial listing
    nodes_listed: asyncio.Event | None = None  # set once the node watch has listed every node
    creators: ThreadPoolExecutor | None = None  # sends a batch of pod creates at once (None: one by one)

    def pod_gone(self, namespace: str, job: str, pod: dict[str, Any]) -> None:
        """Keep a deleted training pod's last state (why it went) until a reconcile of its job has seen it."""
        view = PodView.from_pod(pod)
        self.recent.pod_gone(f"{namespace}/{job}", view.uid)
        if view.index < 0:  # the rendezvous store pod: only its absence matters
            return
        self.departed.setdefault(f"{namespace}/{job}", {})[view.name] = view

    def forget(self, uid: str, namespace: str = "", name: str = "") -> None:
        """Drop what is kept per job once the job is gone: departed pods, missing pods, phase gauge."""
        self.departed.pop(f"{namespace}/{name}", None)
        self.missing.pop(f"{namespace}/{name}", None)
        self.unwatched.pop(f"{namespace}/{name}", None)
        self.seen.pop(uid, None)
        self.recent.forget(f"{namespace}/{name}", uid)
        self.metrics.observe_phase(uid, None)
        self.metrics.jobs.forget(uid)


@dataclass(frozen=True)
class Snapshot:
    """One job as the watches show it, taken on the event loop (the indexes change there) for a reconcile
    in a worker thread: no reconcile reads the API server."""

    body: dict[str, Any]  # the job, with the status fields this operator owns as it last wrote them
    pods: list[PodView]  # every pod with the job's name label: its training pods and its store pod
    nodes: dict[str, NodeView]  # the nodes those pods are on (a name missing here: that node is gone)
    host_ports: frozenset[int] = frozenset()  # ports of host-network jobs that have not finished
    unconfirmed: frozenset[str] = frozenset()  # nodes pods name that the watch has neither listed nor deleted


@dataclass(frozen=True)
class Outcome:
    status: ShardedTrainingJobStatus
    due: dt.datetime | None  # when a rule that depends on the clock could decide otherwise


def adopt(obj: dict[str, Any], owner: dict[str, Any]) -> dict[str, Any]:
    """Owner reference (controller) and namespace, so children are garbage-collected with the job."""
    meta = owner["metadata"]
    obj["metadata"]["namespace"] = meta["namespace"]
    obj["metadata"].setdefault("ownerReferences", []).append(
        {
            "apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True,
        }
    )  # fmt: skip
    return obj


def reconcile(ctx: Context, snap: Snapshot, logger: logging.Logger) -> Outcome | None:
    """Bring one job one step closer to its spec. Safe to call any number of times, from any event. None:
    the job is gone or going.

    Every status write is fenced by the resourceVersion the decision was taken from. A refusal means the job
    changed since (a progress report, or another replica that holds the Lease now): the job is read again and
    the decision taken anew, so no decision from an older view ever lands over a newer one."""
    namespace, name = snap.body["metadata"]["namespace"], snap.body["metadata"]["name"]
    for _ in range(STALE_RETRIES):
        try:
            return _reconcile(ctx, snap, logger)
        except Stale as e:
            logger.info("deciding again: %s", e)
            if not ctx.leadership.acting():
                return None
            ctx.metrics.stale_writes.inc()
            fresh = ctx.kube.get_job(namespace, name)
            if fresh is None or fresh["metadata"]["uid"] != snap.body["metadata"]["uid"]:
                return None
            snap = dataclasses.replace(snap, body=fresh)
    raise Stale(f"{namespace}/{name} changed under {STALE_RETRIES} decisions in a row; looked at again later")


def _reconcile(ctx: Context, snap: Snapshot, logger: logging.Logger) -> Outcome | None:
    body = snap.body
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    with ctx.metrics.reconcile_seconds.time():
        if body["metadata"].get("deletionTimestamp"):
            return None
        try:
            job = ShardedTrainingJob.model_validate(body)
        except ValidationError as e:
            return _invalid(ctx, body, format_validation_error(e, prefix="spec."), logger)
        if refused := forbidden(job.spec, ctx.settings.forbid_pod_overrides, ctx.settings.allow):
            return _invalid(ctx, body, refused, logger)
        uid = body["metadata"]["uid"]
        key = f"{namespace}/{name}"
        pods = [p for p in snap.pods if p.owner_uid == uid and p.index >= 0]
        # Pods of a deleted job of the same name, still going (its store pod too): not ours to judge.
        foreign = [p.name for p in snap.pods if p.owner_uid != uid]
        store_name = names.store_pod_name(job)
        store = next((p for p in snap.pods if p.index < 0 and p.owner_uid == uid and p.name == store_name), None)
        departed = ctx.departed.get(key, {})
        observed = Observed(pods=pods, nodes=confirmed(ctx, snap, logger), departed=departed, foreign=foreign,
                            store=store, store_listed=True)  # fmt: skip
        now = dt.datetime.now(dt.UTC)
        first_look = key not in ctx.missing
        seen_missing = ctx.missing.get(key, {})
        ctx.missing[key] = {p: seen_missing.get(p, iso(now)) for p in missing_pods(job, job.status, observed)}
        unwatched = ctx.unwatched.get(key, set(ctx.missing[key]) if first_look else set()) & ctx.missing[key].keys()
        ctx.unwatched[key] = unwatched
        # Not hearing now: the timers have not started (they start from now at the earliest).
        hearing_since = iso(ctx.hearing.since or now)
        observed = dataclasses.replace(observed, missing_since=ctx.missing[key], unwatched=frozenset(unwatched),
                                       hearing_since=hearing_since)  # fmt: skip
        grace = {"restart": ctx.settings.restart_grace_seconds, "suspend": ctx.settings.suspend_grace_seconds}
        plan = decide(job, observed, now, grace)
        # Departed pods matter only to the attempt they belonged to.
        for pod_name in [n for n, v in departed.items() if v.attempt < plan.status.attempt]:
            del departed[pod_name]

        before = job.status
        old = owned(before.model_dump(by_alias=True, exclude_none=True, mode="json"))
        has_status = bool(body.get("status"))

        version = body["metadata"].get("resourceVersion")

        def record() -> bool:
            """Write the owned status fields the decision changed since the last write, over the version it
            was decided from (Stale if the job changed since); False: the job was replaced meanwhile (its
            status is the new one's to write)."""
            nonlocal old, has_status, version
            new = owned(plan.status.model_dump(by_alias=True, exclude_none=True, mode="json"))
            if new == old:
                return True
            written = ctx.kube.patch_status(namespace, name, new, uid=uid, before=old if has_status else None,
                                            resource_version=version)  # fmt: skip
            if not written:
                logger.info("the job was replaced while it was being reconciled: its status is the new one's to write")
                return False
            # Which version each decision landed over and produced: the chain that shows no decision was
            # taken from an older view than the last one written, whichever replica wrote it.
            logger.info("status of %s/%s written over resourceVersion %s -> %s", namespace, name, version,
                        written.resource_version)  # fmt: skip
            version = written.resource_version
            ctx.recent.status_written(uid, new, version)
            old, has_status = new, True
            return True

        # 0. a decision that deletes pods is written before the deletes: an operator that dies between them
        #    leaves a status that says why the pods went (a restart for a failure is counted, not taken by
        #    the next process for a pod that vanished while nobody watched)
        if (plan.delete or plan.force_delete or plan.delete_store) and not record():
            return None
        if not ctx.leadership.acting():  # the write took long enough for the Lease to lapse: stop here
            return None
        # 1. tear down what must go (old attempts, failed gangs, suspended or finished pods), and force
        #    out pods a lost node will never confirm gone
        #    Each by the UID observed: a decision from this listing never touches a newer pod of the same name.
        uids = {p.name: p.uid for p in pods}
        for pod in plan.delete:
            ctx.kube.delete_pod(namespace, pod, plan.grace_seconds, uid=uids.get(pod))
        for pod in plan.force_delete:
            ctx.kube.delete_pod(namespace, pod, 0, uid=uids.get(pod))
        if plan.delete_store:
            store_uid = store.uid if store else None
            ctx.kube.delete_pod(namespace, names.store_pod_name(job), plan.store_grace, uid=store_uid)
        # 2. children the pods need, then the pods of the current attempt (built from the decided status:
        #    a host-network job's port is chosen once, before its first child)
        if job.spec.network.host_network and plan.status.host_port is None and plan.status.phase not in FINISHED:
            plan.status.host_port = rendezvous.choose_host_port(uid, ctx.settings.host_ports, set(snap.host_ports))
        decided = job.model_copy(update={"status": plan.status})
        due = next_due(job, plan.status, observed, now)
        if (plan.create or plan.create_store) and not ctx.leadership.acting():
            return None
        if plan.create or plan.create_store:
            refusal = held = None
            try:
                # The pods would mount or resolve another job's objects while it is held.
                held = _ensure_children(ctx, decided, body)
                built = [] if held else podspec.build_pods(decided, plan.create, plan.status.attempt, ctx.settings)
                pods = [adopt(pod, body) for pod in built]
                if plan.create_store and not held:  # first: the training pods' rendezvous needs it
                    pods.insert(0, adopt(podspec.build_store_pod(decided, ctx.settings), body))
                for created in _create_pods(ctx, namespace, pods):
                    view = PodView.from_pod(created)
                    ctx.recent.pod_created(key, view)
                    if view.index >= 0:
                        ctx.metrics.pods_created.inc()
            except MissingAPI as e:
                return _invalid(ctx, body, str(e), logger)
            except Refused as e:  # retried at the next reconcile: a quota may free up, a policy may change
                logger.warning("create refused: %s", e)
                refusal = (e.reason, f"{e.kind} {e.name}: {e.message}")
            if held or refusal:
                # Not started: pods never created are not missing ones (which end a started attempt).
                why = f"{held} of a deleted job of the same name still exists" if held else "the API server refused"
                reason = Reason.CREATE_REFUSED if refusal else Reason.WAITING_FOR_PREVIOUS_JOB
                set_phase(plan.status, Phase.PENDING, reason, why, iso(now))
            record_refusal(plan, refusal, iso(now))
            # Nothing watched announces a held name freed or a quota freed: look again after a while.
            if held or refusal:
                again = now + dt.timedelta(seconds=HELD_SECONDS if held else REFUSED_SECONDS)
                due = min(due or again, again)
        # 3. the status write (the rest of it after step 0), only when something changed
        #    (the fields progress reports write are theirs: this patch never names them)
        if not ctx.leadership.acting() or not record():
            return None
        # 4. events and metrics for what changed, once the status that records it is written: a
        #    reconcile that fails before this point is retried and must not repeat them
        for type_, reason, message in plan.events:
            logger.info("%s: %s", reason, message)
            ctx.kube.event(body, type_, reason, message)
        if plan.status.restarts > before.restarts:
            ctx.metrics.restarts.labels(namespace).inc()
        if plan.status.last_failure and plan.status.last_failure != before.last_failure:
            ctx.metrics.failures.labels(plan.status.last_failure.reason).inc()
        if plan.status.phase in FINISHED and before.phase != plan.status.phase:
            ctx.metrics.finished.labels(plan.status.phase).inc()
        ctx.metrics.observe_phase(uid, plan.status.phase)
        ctx.metrics.jobs.update(uid, namespace, name, plan.status)
        if plan.delete_job:
            logger.info("ttlSecondsAfterFinished reached: deleting the job")
            ctx.kube.delete_job(namespace, name)
            ctx.forget(uid, namespace, name)
            return None
        return Outcome(plan.status, due)


def confirmed(ctx: Context, snap: Snapshot, logger: logging.Logger) -> dict[str, NodeView]:
    """The snapshot's nodes, and those it could not vouch for as the API server has them now: a node is
    declared gone only on the watch's word or a 404, never because the watch has not reported it yet. One
    that cannot be looked up counts as not Ready since an unknown time (never lost, looked at again)."""
    nodes = dict(snap.nodes)
    for name in snap.unconfirmed:
        try:
            node = ctx.kube.get_node(name)
        except (ApiError, OSError) as e:
            logger.warning("node %s is not in the node watch and could not be looked up (%s): not judged yet", name, e)
            nodes[name] = NodeView(ready=False)
            continue
        if node is not None:
            nodes[name] = NodeView.from_node(node)
    return nodes


def _send(ctx: Context, namespace: str, objs: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """Create `objs` at once, a request each on the creator threads; each answer in order (the object as
    created, None if one of that name existed). Every answer is in before the first refusal or error is
    raised."""
    if ctx.creators is None or len(objs) <= 1:
        return [ctx.kube.create(namespace, obj) for obj in objs]
    futures = [ctx.creators.submit(ctx.kube.create, namespace, obj) for obj in objs]
    wait(futures)
    if errors := [f.exception() for f in futures if f.exception()]:
        raise errors[0]
    return [f.result() for f in futures]


# How much each batch of a job's pod creates grows over the last. Kubernetes' Job and ReplicaSet controllers
# double it; a gang is useless until its last pod exists, so its start is the number of round trips in a row:
# 1, 8, 64, 512 creates a 9-pod job in two and a 1,024-pod job in five (eleven when doubling). A quota that
# admits the first pod and not the rest still wastes at most 8 refused requests per pod created.
SLOW_START_GROWTH = 8


def _create_pods(ctx: Context, namespace: str, pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Create the pods in batches of 1, 8, 64... sent at once (a slow start, as Kubernetes' own controllers'):
    a large gang is created in a few round trips, and a refusal (a quota, a policy) of the first costs one
    request, not one per pod. Returns those created (not those that existed)."""
    created: list[dict[str, Any]] = []
    batch, rest = 1, list(pods)
    while rest:
        sent, rest = rest[:batch], rest[batch:]
        created += [made for made in _send(ctx, namespace, sent) if made]
        batch *= SLOW_START_GROWTH
    return created


def _ensure_children(ctx: Context, job: ShardedTrainingJob, body: dict[str, Any]) -> str | None:
    """Create what the pods need, all at once (a job's start is a chain of round trips: one less per child);
    returns a child whose name is still held by another job's object."""
    ns, uid = body["metadata"]["namespace"], body["metadata"]["uid"]
    objects = [adopt(rendezvous.build_service(job), body), adopt(children.build_config_map(job, ctx.settings), body)]
    if (group := podgroup.build_pod_group(job)) is not None:
        objects.append(adopt(group, body))
    if (pvc := children.build_pvc(job)) is not None:
        assert job.spec.checkpoint and job.spec.checkpoint.volume_claim
        if not job.spec.checkpoint.volume_claim.retain_on_delete:
            pvc = adopt(pvc, body)
        pvc["metadata"]["namespace"] = ns
        objects.append(pvc)
    # A retained claim an earlier job of this name created (no owner, another UID recorded on it) is this
    # job's to resume from; one still owned by a deleted job, or being deleted, is not usable yet. A PodGroup
    # of the same name is the scheduler's, whoever made it.
    for child, made in zip(objects, _send(ctx, ns, objects), strict=True):
        if made is None and child["kind"] == "PodGroup":
            _follow_pod_group(ctx, ns, child)
        elif made is None and _held(ctx.kube.read_meta(ns, child), uid):
            return f"{child['kind']} {child['metadata']['name']}"
    return None


def _follow_pod_group(ctx: Context, namespace: str, group: dict[str, Any]) -> None:
    """An existing PodGroup is brought to what the job asks now before its pods are created: the scheduler
    would otherwise wait for a gang of the old size (nodes changed while suspended) or place one short."""
    have = ctx.kube.read(namespace, group)
    if have is not None and (fields := podgroup.drift(group, have)):
        ctx.kube.patch_spec(namespace, group, fields)


def owned(status: dict[str, Any]) -> dict[str, Any]:
    """The status fields reconcile writes: all but those progress reports write."""
    return {k: v for k, v in status.items() if k not in REPORT_FIELDS}


def _held(meta: dict[str, Any] | None, uid: str) -> bool:
    """An existing child named like ours that belongs to another job (whose deletion is still under way)."""
    if meta is None:  # gone since the create said it existed: create it at the next reconcile
        return True
    return bool(meta.get("deletionTimestamp")) or controller_uid(meta) not in (uid, None)


def _invalid(ctx: Context, body: dict[str, Any], message: str, logger: logging.Logger) -> Outcome:
    """A job the operator cannot run (it slipped past admission, or needs a missing API): Failed, once."""
    current = body.get("status") or {}
    status = ShardedTrainingJobStatus.model_validate(current)
    if status.phase == Phase.FAILED:
        return Outcome(status, None)
    now = iso()
    status.completion_time = now
    set_phase(status, Phase.FAILED, Reason.INVALID_SPEC, message, now)
    logger.error("invalid job: %s", message)
    dump = status.model_dump(by_alias=True, exclude_none=True, mode="json")
    uid = body["metadata"]["uid"]
    written = ctx.kube.patch_status(body["metadata"]["namespace"], body["metadata"]["name"], dump, uid=uid,
                                    resource_version=body["metadata"].get("resourceVersion"))  # fmt: skip
    if written:
        ctx.recent.status_written(uid, owned(dump), written.resource_version)
        ctx.kube.event(body, EventType.WARNING, Reason.INVALID_SPEC, message)
    ctx.metrics.failures.labels(Reason.INVALID_SPEC).inc()
    return Outcome(status, None)
