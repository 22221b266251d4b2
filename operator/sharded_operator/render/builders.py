"""Pure builders: (job, settings) -> the Service, ConfigMap, PVC, PodGroup and Pod manifests of a job.

No API calls here; reconcile creates what these return and adds the owner reference itself
(`reconcile.adopt`), except on the checkpoint PVC, which outlives the job unless told otherwise.
Every variable a pod gets is named in `sharded_api.contract.PodEnv`.
"""

from __future__ import annotations

import hashlib
import posixpath
import zlib
from collections.abc import Iterable
from decimal import Decimal
from typing import Any

import yaml

from sharded_api.config import CheckpointConfig, TrainerConfig
from sharded_api.contract import CONTRACT_VERSION, PROGRESS_TOKEN_DIR, PROGRESS_TOKEN_FILE, PodEnv
from sharded_api.quantity import quantity_value
from sharded_operator.api.models import (
    ANNOTATION_CREATED_BY,
    CONTAINER,
    LABEL_ATTEMPT,
    LABEL_INDEX,
    LABEL_JOB,
    LABEL_ROLE,
    ROLE_RENDEZVOUS,
    STORE_CONTAINER,
    ShardedTrainingJob,
)
from sharded_operator.render.security import (
    KUEUE_GROUP,
    KUEUE_GROUP_COUNT,
    KUEUE_QUEUE,
    extra_container,
    kueue_group,
    pod_security,
    restricted,
)
from sharded_operator.settings import OperatorSettings

SHM_DEFAULT_BYTES = 2 * 2**30
_MAX_QUANTITY = Decimal(2**63 - 1)


def _name(job: ShardedTrainingJob) -> str:
    return job.metadata["name"]


def _ns(job: ShardedTrainingJob) -> str:
    return job.metadata.get("namespace", "default")


def job_labels(job: ShardedTrainingJob) -> dict[str, str]:
    return {LABEL_JOB: _name(job)}


def pod_name(job: ShardedTrainingJob, index: int) -> str:
    return f"{_name(job)}-{index}"


def pvc_name(job: ShardedTrainingJob) -> str:
    return f"{_name(job)}-checkpoints"


def config_map_name(job: ShardedTrainingJob) -> str:
    """`<job>-config-<hash of the trainer config>`: a pod mounts the config its attempt was created with,
    so an edit of the spec takes effect at the next attempt and never under a running one."""
    return f"{_name(job)}-config-{config_digest(job)}"


def config_digest(job: ShardedTrainingJob) -> str:
    rendered = trainer_config(job).model_dump_json(by_alias=True, exclude_none=True)
    return hashlib.sha256(rendered.encode()).hexdigest()[:10]


def procs_per_node(job: ShardedTrainingJob, settings: OperatorSettings) -> int:
    s = job.spec
    if s.procs_per_node != "auto":
        return int(s.procs_per_node)
    return s.resources.gpus_per_node or settings.cpu_procs_per_node


def backend(job: ShardedTrainingJob) -> str:
    s = job.spec
    if s.network.backend != "auto":
        return s.network.backend
    return "nccl" if s.resources.gpus_per_node > 0 else "gloo"


def rendezvous_port(job: ShardedTrainingJob) -> int:
    """The spec's port; on the host network the job's own host port (`status.hostPort`, see
    `choose_host_port`), which every pod declares as a hostPort so the scheduler never puts two jobs that
    bind the same port on one node."""
    s = job.spec
    if not s.network.host_network:
        return s.rendezvous.port
    if job.status.host_port is None:  # chosen by reconcile before any child is built; a fallback for safety
        lo, hi = DEFAULT_HOST_PORTS
        return lo + zlib.crc32(job.metadata.get("uid", _name(job)).encode()) % (hi - lo + 1)
    return job.status.host_port


DEFAULT_HOST_PORTS = (29500, 30499)


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


def store_pod_name(job: ShardedTrainingJob) -> str:
    return f"{_name(job)}-rdzv"


def pod_host(job: ShardedTrainingJob, pod: str) -> str:
    """A pod's stable DNS name through the job's headless Service (its hostname + subdomain)."""
    return f"{pod}.{_name(job)}.{_ns(job)}.svc"


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


# --- children -----------------------------------------------------------------------------------


def build_service(job: ShardedTrainingJob) -> dict[str, Any]:
    """Headless; publishes not-ready addresses so peers resolve before the trainer is ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": _name(job), "labels": job_labels(job)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": job_labels(job),
            "ports": [{"name": "rendezvous", "port": rendezvous_port(job), "targetPort": rendezvous_port(job)}],
        },
    }


def trainer_config(job: ShardedTrainingJob) -> TrainerConfig:
    """The full trainer config the pods read: the spec's training part plus strategy, storage and backend."""
    s = job.spec
    checkpoint = CheckpointConfig()
    if s.checkpoint:
        policy = s.checkpoint.model_dump(include={"interval", "keep_last", "async_save", "resume"})
        checkpoint = CheckpointConfig(dir=s.checkpoint.mount_path, **policy)
    # An elastic job keeps its full size's batch; the processes per node are known to the trainer only.
    batch_nodes = s.elastic.max_nodes if s.elastic and s.elastic.keep_global_batch else None
    return TrainerConfig(
        **s.trainer.model_dump(), strategy=s.strategy, checkpoint=checkpoint, backend=backend(job),
        batch_nodes=batch_nodes,
    )  # fmt: skip


# libyaml's emitter where PyYAML has it: the same text, a fifth of the pure-Python one's CPU per job.
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def build_config_map(job: ShardedTrainingJob, settings: OperatorSettings) -> dict[str, Any]:
    """The trainer config, under the file name the pods read it as (settings.trainer_config_path)."""
    cfg = trainer_config(job).model_dump(by_alias=True, exclude_none=True, mode="json")
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": config_map_name(job), "labels": job_labels(job)},
        "data": {posixpath.basename(settings.trainer_config_path): yaml.dump(cfg, Dumper=_DUMPER, sort_keys=False)},
    }


def build_pvc(job: ShardedTrainingJob) -> dict[str, Any] | None:
    ck = job.spec.checkpoint
    if not ck or not ck.volume_claim:
        return None
    vc = ck.volume_claim
    spec: dict[str, Any] = {"accessModes": list(vc.access_modes), "resources": {"requests": {"storage": str(vc.size)}}}
    if vc.storage_class_name:
        spec["storageClassName"] = vc.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": pvc_name(job),
            "labels": job_labels(job),
            "annotations": {ANNOTATION_CREATED_BY: job.metadata.get("uid", "")},
        },
        "spec": spec,
    }


def build_pod_group(job: ShardedTrainingJob) -> dict[str, Any] | None:
    gang = job.spec.scheduling.gang
    if not gang.enabled:
        return None
    meta = {"name": _name(job), "labels": job_labels(job)}
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
        PodEnv.RDZV_ID: f"{job.metadata.get('uid', _name(job))}-{attempt}",
        PodEnv.RDZV_CONF: rendezvous_conf(job),
        PodEnv.MAX_RESTARTS: str(s.elastic.max_restarts if s.elastic else s.failure_policy.in_place_restarts),
        PodEnv.MASTER_ADDR: pod_host(job, pod_name(job, 0)),
        PodEnv.MASTER_PORT: str(port),
        PodEnv.JOB_NAME: _name(job),
        PodEnv.JOB_NAMESPACE: _ns(job),
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


def _resources(job: ShardedTrainingJob) -> dict[str, Any]:
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
        "subdomain": _name(job),
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
    if sched.queue_name:
        # One Kueue workload per attempt (a pod group): Kueue admits all of its pods at once or none, and a
        # restarted gang queues again as a new group.
        labels[KUEUE_QUEUE] = sched.queue_name
        labels[KUEUE_GROUP] = kueue_group(job, attempt)
        annotations[KUEUE_GROUP_COUNT] = str(s.nodes)
    scheduler_name = sched.scheduler_name
    if sched.gang.enabled and sched.gang.provider == "volcano":
        annotations["scheduling.k8s.io/group-name"] = _name(job)
        scheduler_name = scheduler_name or "volcano"
    elif sched.gang.enabled:
        labels["scheduling.x-k8s.io/pod-group"] = _name(job)

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
                "subPath": s.checkpoint.sub_path or _name(job),
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
    if resources := _resources(job):
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
        "subdomain": _name(job),
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
