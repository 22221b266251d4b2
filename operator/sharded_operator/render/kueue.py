"""Kueue: a job's pods as one pod group per attempt, admitted all together or not at all."""

from __future__ import annotations

from typing import Any

from sharded_operator.api.models import ShardedTrainingJob

KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP = "kueue.x-k8s.io/pod-group-name"
KUEUE_GROUP_COUNT = "kueue.x-k8s.io/pod-group-total-count"


def kueue_group(job: ShardedTrainingJob, attempt: int) -> str:
    """<name>-<attempt>-<uid prefix>: unique to this job object's attempt (a re-created job of the same name
    gets new groups), and a label value of at most 63 characters (names are at most 50)."""
    return f"{job.metadata['name']}-{attempt}-{job.metadata.get('uid', '')[:5]}".rstrip("-")[:63]


def kueue_metadata(job: ShardedTrainingJob, attempt: int) -> tuple[dict[str, str], dict[str, Any]]:
    """The labels and annotations that put a training pod in its attempt's pod group, when the job names a
    queue. One Kueue workload per attempt: Kueue admits all of its pods at once or none, and a restarted
    gang queues again as a new group."""
    if not job.spec.scheduling.queue_name:
        return {}, {}
    labels = {KUEUE_QUEUE: job.spec.scheduling.queue_name, KUEUE_GROUP: kueue_group(job, attempt)}
    return labels, {KUEUE_GROUP_COUNT: str(job.spec.nodes)}
