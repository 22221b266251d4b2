"""Gang scheduling through a PodGroup: Volcano's or the scheduler-plugins coscheduling plugin's, and what
puts each training pod in it."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from sharded_api.quantity import quantity_value
from sharded_operator.api.models import ShardedTrainingJob
from sharded_operator.render.names import job_labels, job_name
from sharded_operator.render.resources import container_resources

VOLCANO_API = "scheduling.volcano.sh/v1beta1"
VOLCANO_SCHEDULER = "volcano"  # the name Volcano's chart gives its scheduler: gang pods go there by default
COSCHEDULING_API = "scheduling.x-k8s.io/v1alpha1"
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
COSCHEDULING_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"


def min_member(job: ShardedTrainingJob) -> int:
    """The pods that must be placed together: every node of a fixed-size job; an elastic job trains with
    minNodes, so only those wait for each other (the rest join as capacity allows)."""
    return job.spec.elastic.min_nodes if job.spec.elastic else job.spec.nodes


def min_resources(job: ShardedTrainingJob) -> dict[str, str]:
    """What the gang's minMember pods request together: both schedulers hold a group whose sum the cluster
    cannot give before any of its pods is placed (Volcano keeps it out of its queue, coscheduling rejects it
    at PreFilter), instead of placing pods one by one until the last does not fit."""
    requests = container_resources(job).get("requests", {})
    n = min_member(job)
    return {name: _plain(quantity_value(q) * n) for name, q in requests.items()}


def _plain(v: Decimal) -> str:
    """A quantity in base units without an exponent ("8", "137438953472", "0.5")."""
    return format(v.normalize(), "f")


def build_pod_group(job: ShardedTrainingJob) -> dict[str, Any] | None:
    gang = job.spec.scheduling.gang
    if not gang.enabled:
        return None
    meta = {"name": job_name(job), "labels": job_labels(job)}
    spec: dict[str, Any] = {"minMember": min_member(job)}
    if resources := min_resources(job):
        spec["minResources"] = resources
    if gang.provider == "volcano":
        if job.spec.scheduling.priority_class_name:
            spec["priorityClassName"] = job.spec.scheduling.priority_class_name
        if gang.queue:
            spec["queue"] = gang.queue
        return {"apiVersion": VOLCANO_API, "kind": "PodGroup", "metadata": meta, "spec": spec}
    spec["scheduleTimeoutSeconds"] = gang.schedule_timeout_seconds
    return {"apiVersion": COSCHEDULING_API, "kind": "PodGroup", "metadata": meta, "spec": spec}


def drift(want: dict[str, Any], have: dict[str, Any]) -> dict[str, Any]:
    """The fields of `want`'s spec that the existing PodGroup `have` lacks or holds otherwise (a spec edited
    while suspended, an elastic job's minNodes, a group left by an earlier job of the same name): what a
    merge patch must set. Fields the scheduler adds are left alone."""
    current = have.get("spec") or {}
    return {k: v for k, v in want["spec"].items() if current.get(k) != v}


def podgroup_metadata(job: ShardedTrainingJob) -> tuple[dict[str, str], dict[str, str], str | None]:
    """The labels, annotations and scheduler name that make a training pod a member of the job's PodGroup
    (none without gang scheduling)."""
    sched = job.spec.scheduling
    if not sched.gang.enabled:
        return {}, {}, sched.scheduler_name
    if sched.gang.provider == "volcano":
        return {}, {VOLCANO_GROUP_ANNOTATION: job_name(job)}, sched.scheduler_name or VOLCANO_SCHEDULER
    return {COSCHEDULING_GROUP_LABEL: job_name(job)}, {}, sched.scheduler_name
