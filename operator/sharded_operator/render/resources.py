"""What one training pod asks of a node, shared by the pod and by the gang's PodGroup (which asks for its
members' sum at once)."""

from __future__ import annotations

from typing import Any

from sharded_operator.api.models import ShardedTrainingJob


def container_resources(job: ShardedTrainingJob) -> dict[str, Any]:
    """The training container's requests and limits (empty when the spec asks for nothing)."""
    r = job.spec.resources
    amounts: dict[str, str] = {}
    if r.cpu is not None:
        amounts["cpu"] = str(r.cpu)
    if r.memory is not None:
        amounts["memory"] = str(r.memory)
    if r.gpus_per_node:
        amounts[r.gpu_resource_name] = str(r.gpus_per_node)
    ib = job.spec.network.infiniband
    if ib.enabled:
        amounts[ib.resource_name] = str(ib.resource_count)
    # Requests equal limits unless the spec raises a limit: extended resources require it, and training wants
    # Guaranteed QoS by default.
    limits = dict(amounts)
    if r.cpu_limit is not None:
        limits["cpu"] = str(r.cpu_limit)
    if r.memory_limit is not None:
        limits["memory"] = str(r.memory_limit)
    return {"requests": amounts, "limits": limits} if limits else {}
