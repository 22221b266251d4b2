"""Pure builders of a job's pods: (job, index, attempt, settings) -> the training pods, and the pod that
serves the rendezvous store. Every variable a pod gets is named in `sharded_api.contract.PodEnv`."""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from decimal import Decimal
from typing import Any

from sharded_api.contract import CONTRACT_VERSION, PROGRESS_TOKEN_DIR, PROGRESS_TOKEN_FILE, PodEnv
from sharded_api.quantity import quantity_value
from sharded_operator.api.models import (
    CONTAINER,
    LABEL_ATTEMPT,
    LABEL_INDEX,
    LABEL_ROLE,
    ROLE_RENDEZVOUS,
    STORE_CONTAINER,
    ShardedTrainingJob,
)
from sharded_operator.render.children import config_map_name
from sharded_operator.render.kueue import kueue_metadata
from sharded_operator.render.names import (
    job_labels,
    job_name,
    job_namespace,
    pod_host,
    pod_name,
    pvc_name,
    store_pod_name,
)
from sharded_operator.render.podgroup import podgroup_metadata
from sharded_operator.render.rendezvous import rendezvous_conf, rendezvous_endpoint, rendezvous_port
from sharded_operator.render.resources import container_resources
from sharded_operator.render.security import extra_container, pod_security, restricted
from sharded_operator.settings import OperatorSettings

SHM_DEFAULT_BYTES = 2 * 2**30
_MAX_QUANTITY = Decimal(2**63 - 1)


def procs_per_node(job: ShardedTrainingJob, settings: OperatorSettings) -> int:
    s = job.spec
    if s.procs_per_node != "auto":
        return int(s.procs_per_node)
    return s.resources.gpus_per_node or settings.cpu_procs_per_node


def termination_grace(job: ShardedTrainingJob, settings: OperatorSettings) -> int:
    """Seconds a stopped pod has for its final checkpoint: the job's own, else the operator's default."""
    own = job.spec.run_policy.termination_grace_seconds
    return settings.suspend_grace_seconds if own is None else own


def shm_size(job: ShardedTrainingJob) -> str:
    """/dev/shm: the spec's size, else half the pod's memory (NCCL and data loaders live there), else 2Gi."""
    s = job.spec
    if s.shm_size is not None:
        return str(s.shm_size)
    if s.resources.memory is not None:
        # The API server caps quantities at 2^63 - 1; so does this, before halving an absurd "1e999".
        return str(int(min(quantity_value(s.resources.memory), _MAX_QUANTITY) / 2))
    return str(SHM_DEFAULT_BYTES)


def _env(job: ShardedTrainingJob, index: int, attempt: int, settings: OperatorSettings) -> list[dict[str, Any]]:
    s = job.spec
    port = rendezvous_port(job)
    nnodes = f"{s.elastic.min_nodes}:{s.elastic.max_nodes}" if s.elastic else str(s.nodes)
    env = {
        PodEnv.NNODES: nnodes,
        PodEnv.NPROC_PER_NODE: str(procs_per_node(job, settings)),
        PodEnv.NODE_RANK: str(index),
        PodEnv.RDZV_BACKEND: "c10d",
        PodEnv.RDZV_ENDPOINT: rendezvous_endpoint(job),
        PodEnv.RDZV_ID: f"{job.metadata.get('uid', job_name(job))}-{attempt}",
        PodEnv.RDZV_CONF: rendezvous_conf(job),
        PodEnv.MAX_RESTARTS: str(s.elastic.max_restarts if s.elastic else s.failure_policy.in_place_restarts),
        PodEnv.MASTER_ADDR: pod_host(job, pod_name(job, 0)),
        PodEnv.MASTER_PORT: str(port),
        PodEnv.JOB_NAME: job_name(job),
        PodEnv.JOB_NAMESPACE: job_namespace(job),
        PodEnv.JOB_UID: job.metadata.get("uid", ""),
        PodEnv.ATTEMPT: str(attempt),
        PodEnv.RDZV_TIMEOUT: str(s.rendezvous.timeout_seconds),
        PodEnv.CONTRACT_VERSION: str(CONTRACT_VERSION),
    }
    if settings.progress_url:
        env[PodEnv.PROGRESS_URL] = settings.progress_url
        env[PodEnv.PROGRESS_TOKEN_FILE] = f"{PROGRESS_TOKEN_DIR}/{PROGRESS_TOKEN_FILE}"
    if s.resources.gpus_per_node == 0:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU fallback, even on a node that has GPUs
    ib = s.network.infiniband
    if ib.enabled:
        env["NCCL_IB_DISABLE"] = "0"
        if ib.hcas:
            env["NCCL_IB_HCA"] = ib.hcas
        if ib.gid_index is not None:
            env["NCCL_IB_GID_INDEX"] = str(ib.gid_index)
    if s.network.socket_interface:
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = s.network.socket_interface
    out: list[dict[str, Any]] = [{"name": str(k), "value": v} for k, v in env.items()]
    out += [
        {"name": PodEnv.POD_NAME.value, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": PodEnv.NODE_NAME.value, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]
    out += [e.model_dump(by_alias=True, exclude_none=True) for e in s.pod.env]
    return out


def _placement(job: ShardedTrainingJob) -> dict[str, Any]:
    """What every pod of the job shares, the store pod too: where it may run, its priority, its identity
    and pull secrets (only the fields set)."""
    s, sched = job.spec, job.spec.scheduling
    fields = {
        "nodeSelector": sched.node_selector or None,
        "tolerations": sched.tolerations or None,
        "priorityClassName": sched.priority_class_name,
        "serviceAccountName": s.pod.service_account_name,
        "imagePullSecrets": [{"name": n} for n in s.pod.image_pull_secrets],
    }
    return {k: v for k, v in fields.items() if v}


# Importing torch for its TCPStore takes about 0.5 GiB; the store itself holds a few keys per node.
STORE_RESOURCES = {"cpu": "250m", "memory": "1Gi"}


def build_store_pod(job: ShardedTrainingJob, settings: OperatorSettings) -> dict[str, Any]:
    """The rendezvous store: torchrun's c10d TCPStore in a small pod of its own, one per job, serving every
    attempt (each has its own rendezvous id). No training pod's death takes it with it, so a lost pod is
    replaced alone; losing the store restarts the gang. It asks for no GPU and joins no gang or queue, but
    keeps the job's node selection, tolerations and priority so it can run wherever the job may."""
    s = job.spec
    port = rendezvous_port(job)
    container: dict[str, Any] = {
        "name": STORE_CONTAINER,
        "image": s.image,
        "command": ["python", "-m", "sharded_trainer.store", "--port", str(port)],
        "ports": [{"name": "rendezvous", "containerPort": port}],
        "resources": {"requests": dict(STORE_RESOURCES), "limits": dict(STORE_RESOURCES)},
        "securityContext": restricted({"drop": ["ALL"]}),
    }
    if s.pod.image_pull_policy:
        container["imagePullPolicy"] = s.pod.image_pull_policy
    spec: dict[str, Any] = {
        "hostname": store_pod_name(job),
        "subdomain": job_name(job),
        "restartPolicy": "Never",  # a restarted store would have lost every agent's state
        "terminationGracePeriodSeconds": 5,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "containers": [container],
        "securityContext": pod_security(settings.pod_uid),
    }
    spec.update(_placement(job))
    labels = {**s.pod.labels, **job_labels(job), LABEL_ROLE: ROLE_RENDEZVOUS}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": store_pod_name(job), "labels": labels, "annotations": dict(s.pod.annotations)},
        "spec": spec,
    }


def build_pod(job: ShardedTrainingJob, index: int, attempt: int, settings: OperatorSettings) -> dict[str, Any]:
    return build_pods(job, [index], attempt, settings)[0]


def build_pods(job: ShardedTrainingJob, indexes: Iterable[int], attempt: int,
               settings: OperatorSettings) -> list[dict[str, Any]]:  # fmt: skip
    """The training pods `indexes` of attempt `attempt`. The name of the ConfigMap they mount carries the
    trainer config's digest: rendered once for all of them, not once a pod."""
    config_map = config_map_name(job)
    return [_pod(job, index, attempt, settings, config_map) for index in indexes]


def _pod(job: ShardedTrainingJob, index: int, attempt: int, settings: OperatorSettings,
         config_map: str) -> dict[str, Any]:  # fmt: skip
    s = job.spec
    labels = {**s.pod.labels, **job_labels(job), LABEL_INDEX: str(index), LABEL_ATTEMPT: str(attempt)}
    annotations = dict(s.pod.annotations)
    sched = s.scheduling
    for more_labels, more_annotations in (kueue_metadata(job, attempt), podgroup_metadata(job)[:2]):
        labels.update(more_labels)
        annotations.update(more_annotations)
    scheduler_name = podgroup_metadata(job)[2]

    command = ["python", "-m", "sharded_trainer.launch", "--config", settings.trainer_config_path]
    if s.command:
        command += ["--", *s.command]
    if s.interactive:  # the same pod, environment and volumes; a person starts the runs
        command = ["python", "-m", "sharded_trainer.interactive", "--config", settings.trainer_config_path,
                   "--port", str(s.interactive.port)]  # fmt: skip
        if s.checkpoint:
            command += ["--root-dir", s.checkpoint.mount_path]
    mounts = [
        {"name": "trainer-config", "mountPath": posixpath.dirname(settings.trainer_config_path), "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "trainer-config", "configMap": {"name": config_map}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(job)}},
    ]
    if s.checkpoint:
        claim = s.checkpoint.existing_claim or pvc_name(job)
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim}})
        mounts.append(
            {
                "name": "checkpoints",
                "mountPath": s.checkpoint.mount_path,
                "subPath": s.checkpoint.sub_path or job_name(job),
            }
        )
    if settings.progress_url:
        # The pod proves who it is to the operator with a token for the operator's audience only, bound to
        # the pod (void once it is gone) and rotated by the kubelet: not an API credential.
        token = {"audience": settings.progress_audience, "expirationSeconds": settings.token_seconds,
                 "path": PROGRESS_TOKEN_FILE}  # fmt: skip
        volumes.append({"name": "progress-token", "projected": {"sources": [{"serviceAccountToken": token}]}})
        mounts.append({"name": "progress-token", "mountPath": PROGRESS_TOKEN_DIR, "readOnly": True})
    volumes += s.pod.volumes
    mounts += s.pod.volume_mounts

    port = {"name": "rendezvous", "containerPort": rendezvous_port(job)}
    if s.network.host_network:  # the port is the node's: declared, the scheduler keeps colliding jobs apart
        port["hostPort"] = port["containerPort"]
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": s.image,
        "command": command,
        "env": _env(job, index, attempt, settings),
        "ports": [port],
        "volumeMounts": mounts,
    }
    if s.pod.image_pull_policy:
        container["imagePullPolicy"] = s.pod.image_pull_policy
    if resources := container_resources(job):
        container["resources"] = resources
    # Pod Security `restricted` by default; InfiniBand adds IPC_LOCK only (registering RDMA memory pins
    # pages), which needs the `privileged` level.
    caps: dict[str, list[str]] = {"drop": ["ALL"]}
    if s.network.infiniband.enabled:
        caps["add"] = ["IPC_LOCK"]
    container["securityContext"] = restricted(caps)
    init = [extra_container(c) for c in s.pod.init_containers]
    # Native sidecars (init containers that keep running): started before the trainer, stopped after it, so
    # the pod completes when training does.
    init += [{**extra_container(c), "restartPolicy": "Always"} for c in s.pod.sidecars]

    spec: dict[str, Any] = {
        "hostname": pod_name(job, index),
        "subdomain": job_name(job),
        "restartPolicy": "Never",  # the operator replaces a failed pod (alone or with its gang), never restarts it
        "terminationGracePeriodSeconds": termination_grace(job, settings),
        "enableServiceLinks": False,
        # Training needs no API access: progress goes to the operator over HTTP, not through the API.
        "automountServiceAccountToken": False,
        "containers": [container],
        "volumes": volumes,
        "securityContext": pod_security(settings.pod_uid),
    }
    if s.network.host_network:
        spec["hostNetwork"] = True
        spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    optional = {
        "affinity": sched.affinity,
        "schedulerName": scheduler_name,
        "runtimeClassName": s.pod.runtime_class_name,
        "initContainers": init,
    }
    spec.update(_placement(job))
    spec.update({k: v for k, v in optional.items() if v})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod_name(job, index), "labels": labels, "annotations": annotations},
        "spec": spec,
    }
