"""The names of a job's children and their DNS names: one place, since pods, the Service, decisions and the
command line must all agree on them."""

from __future__ import annotations

from sharded_operator.api.models import LABEL_JOB, ShardedTrainingJob


def job_name(job: ShardedTrainingJob) -> str:
    return job.metadata["name"]


def job_namespace(job: ShardedTrainingJob) -> str:
    return job.metadata.get("namespace", "default")


def job_labels(job: ShardedTrainingJob) -> dict[str, str]:
    return {LABEL_JOB: job_name(job)}


def pod_name(job: ShardedTrainingJob, index: int) -> str:
    return f"{job_name(job)}-{index}"


def pvc_name(job: ShardedTrainingJob) -> str:
    return f"{job_name(job)}-checkpoints"


def store_pod_name(job: ShardedTrainingJob) -> str:
    return f"{job_name(job)}-rdzv"


def pod_host(job: ShardedTrainingJob, pod: str) -> str:
    """A pod's stable DNS name through the job's headless Service (its hostname + subdomain)."""
    return f"{pod}.{job_name(job)}.{job_namespace(job)}.svc"
