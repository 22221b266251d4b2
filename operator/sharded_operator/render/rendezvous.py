"""torchrun's c10d rendezvous wiring: the port (a host port of its own on the host network), the store's
address, the agents' settings, and the headless Service that resolves every pod before it is ready."""

from __future__ import annotations

import zlib
from typing import Any

from sharded_operator.api.models import ShardedTrainingJob
from sharded_operator.render.names import job_labels, job_name, pod_host, store_pod_name
from sharded_operator.settings import DEFAULT_HOST_PORTS


def rendezvous_port(job: ShardedTrainingJob) -> int:
    """The spec's port; on the host network the job's own host port (`status.hostPort`, see
    `choose_host_port`), which every pod declares as a hostPort so the scheduler never puts two jobs that
    bind the same port on one node."""
    s = job.spec
    if not s.network.host_network:
        return s.rendezvous.port
    if job.status.host_port is None:  # chosen by reconcile before any child is built; a fallback for safety
        lo, hi = DEFAULT_HOST_PORTS
        return lo + zlib.crc32(job.metadata.get("uid", job_name(job)).encode()) % (hi - lo + 1)
    return job.status.host_port


def choose_host_port(uid: str, ports: tuple[int, int], used: set[int]) -> int:
    """A port of the range no other active host-network job holds, starting from one derived from the UID
    (so concurrent choices rarely meet). With every port held, the derived one: the declared hostPort then
    keeps the two jobs on different nodes rather than letting them collide."""
    lo, hi = ports
    size = hi - lo + 1
    start = zlib.crc32(uid.encode()) % size
    for i in range(size):
        port = lo + (start + i) % size
        if port not in used:
            return port
    return lo + start


def rendezvous_host(job: ShardedTrainingJob) -> str:
    return pod_host(job, store_pod_name(job))


def rendezvous_conf(job: ShardedTrainingJob) -> str:
    """torchrun's c10d settings. No agent hosts the store (it lives in the store pod). A node that stops
    heartbeating leaves the round after about 6 s (every 2 s, 3 missed) instead of 15, so its replacement
    can join; an elastic round with minNodes waits lastCallSeconds for more, not 30 s."""
    r = job.spec.rendezvous
    conf = {
        "is_host": "false",
        "join_timeout": r.timeout_seconds,
        "last_call_timeout": r.last_call_seconds,
        "keep_alive_interval": 2,
        "keep_alive_max_attempt": 3,
    }
    return ",".join(f"{k}={v}" for k, v in conf.items())


def rendezvous_endpoint(job: ShardedTrainingJob) -> str:
    return f"{rendezvous_host(job)}:{rendezvous_port(job)}"


def build_service(job: ShardedTrainingJob) -> dict[str, Any]:
    """Headless; publishes not-ready addresses so peers resolve before the trainer is ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": job_name(job), "labels": job_labels(job)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": job_labels(job),
            "ports": [{"name": "rendezvous", "port": rendezvous_port(job), "targetPort": rendezvous_port(job)}],
        },
    }
