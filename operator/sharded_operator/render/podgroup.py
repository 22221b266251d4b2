"""Gang scheduling through a PodGroup: Volcano's or the scheduler-plugins coscheduling plugin's, and what
puts each training pod in it."""

from __future__ import annotations

from typing import Any

from sharded_operator.api.models import ShardedTrainingJob
from sharded_operator.render.names import job_labels, job_name


def build_pod_group(job: ShardedTrainingJob) -> dict[str, Any] | None:
    gang = job.spec.scheduling.gang
    if not gang.enabled:
        return None
    meta = {"name": job_name(job), "labels": job_labels(job)}
    if gang.provider == "volcano":
        spec: dict[str, Any] = {"minMember": job.spec.nodes}
        if job.spec.scheduling.priority_class_name:
            spec["priorityClassName"] = job.spec.scheduling.priority_class_name
        return {"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup", "metadata": meta, "spec": spec}
    return {
        "apiVersion": "scheduling.x-k8s.io/v1alpha1",
        "kind": "PodGroup",
        "metadata": meta,
        "spec": {"minMember": job.spec.nodes, "scheduleTimeoutSeconds": gang.schedule_timeout_seconds},
    }


def podgroup_metadata(job: ShardedTrainingJob) -> tuple[dict[str, str], dict[str, str], str | None]:
    """The labels, annotations and scheduler name that make a training pod a member of the job's PodGroup
    (none without gang scheduling)."""
    sched = job.spec.scheduling
    if not sched.gang.enabled:
        return {}, {}, sched.scheduler_name
    if sched.gang.provider == "volcano":
        return {}, {"scheduling.k8s.io/group-name": job_name(job)}, sched.scheduler_name or "volcano"
    return {"scheduling.x-k8s.io/pod-group": job_name(job)}, {}, sched.scheduler_name
