"""The ShardedTrainingJob API: pydantic spec and status, the single source of the CRD in crds/.

Field descriptions become the CRD's OpenAPI descriptions (`kubectl explain stj.spec`), and the
`x-kubernetes-validations` declared next to each model become admission-time CEL rules. The same
rules are mirrored by pydantic validators so an object that slipped past admission (an older CRD,
say) still fails with the same message instead of reaching a pod.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from sharded_trainer.config import (
    RESERVED_ENV,
    RESERVED_ENV_PREFIX,
    CheckpointPolicy,
    Model,
    StrategyConfig,
    TrainingSpec,
)

GROUP = "training.sharded.dev"
VERSION = "v1alpha1"
KIND = "ShardedTrainingJob"
PLURAL = "shardedtrainingjobs"
SHORT_NAME = "stj"
# Pods are named <job>-<index> and double as hostnames (63-character DNS labels); PVCs <job>-checkpoints.
MAX_NAME_LENGTH = 50
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
QUANTITY_RE = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")


def _rule(rule: str, message: str, field_path: str | None = None, reason: str | None = None) -> dict:
    out: dict[str, Any] = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    if reason:
        out["reason"] = reason
    return out


def _immutable(what: str) -> dict:
    return {"x-kubernetes-validations": [_rule("self == oldSelf", f"{what} is immutable after creation")]}


def _quantity_field(description: str, default: str | None = None) -> Any:
    return Field(
        default,
        description=description,
        json_schema_extra={
            "x-kubernetes-int-or-string": True,
            "x-kubernetes-validations": [
                _rule(
                    "type(self) == int ? self >= 0 : isQuantity(self)",
                    "must be a Kubernetes quantity such as 16Gi, 500m or 4",
                )
            ],
        },
    )


def _check_quantity(v: int | str) -> int | str:
    if (isinstance(v, int) and v >= 0) or (isinstance(v, str) and QUANTITY_RE.match(v)):
        return v
    raise ValueError("must be a Kubernetes quantity such as 16Gi, 500m or 4")


Quantity = Annotated[int | str, AfterValidator(_check_quantity)]


class ApiModel(Model):
    """Base of the CRD models; same camelCase and strictness as the trainer config."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Resources(ApiModel):
    """Per-pod compute resources (one pod per node)."""

    gpus_per_node: int = Field(0, ge=0, le=64, description="GPUs requested by each pod; 0 runs on CPU with gloo.")
    gpu_resource_name: str = Field(
        "nvidia.com/gpu", max_length=253, description="Extended resource name of a GPU on your nodes."
    )
    cpu: Quantity | None = _quantity_field("CPU request and limit of each pod, e.g. 32 or 1500m.")
    memory: Quantity | None = _quantity_field("Memory request and limit of each pod, e.g. 512Gi.")


class InfiniBand(ApiModel):
    """RDMA networking for NCCL across nodes."""

    enabled: bool = Field(False, description="Request RDMA devices and set NCCL's InfiniBand variables.")
    resource_name: str = Field(
        "rdma/ib", max_length=253, description="Extended resource the RDMA device plugin advertises."
    )
    resource_count: int = Field(1, ge=1, le=64, description="RDMA devices requested per pod.")
    hcas: str | None = Field(
        None, max_length=512, description="NCCL_IB_HCA value, e.g. mlx5_0,mlx5_1 (unset lets NCCL choose)."
    )
    gid_index: int | None = Field(None, ge=0, le=255, description="NCCL_IB_GID_INDEX (RoCE: usually 3).")


class Network(ApiModel):
    """Collective backend and pod networking."""

    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="auto: nccl when gpusPerNode > 0, gloo otherwise."
    )
    infiniband: InfiniBand = Field(default_factory=InfiniBand, description="InfiniBand / RoCE profile.")
    host_network: bool = Field(
        False, description="Run pods in the node's network namespace (dnsPolicy ClusterFirstWithHostNet)."
    )
    socket_interface: str | None = Field(
        None, max_length=64, description="NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, e.g. eth0 or ^lo,docker."
    )


class Rendezvous(ApiModel):
    """torchrun's c10d rendezvous, hosted by node 0."""

    port: int = Field(29400, ge=1024, le=65535, description="Rendezvous TCP port on node 0.")
    timeout_seconds: int = Field(
        900, ge=30, le=86400, description="How long agents wait for every node to join before failing."
    )


class Elastic(ApiModel):
    """Elastic membership: the gang may run with between minNodes and maxNodes nodes."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [_rule("self.minNodes <= self.maxNodes", "minNodes must not exceed maxNodes")]
        }
    )
    min_nodes: int = Field(..., ge=1, le=1024, description="Fewest nodes training may continue with.")
    max_nodes: int = Field(..., ge=1, le=1024, description="Most nodes the job may use.")
    max_restarts: int = Field(3, ge=0, le=100, description="torchrun's in-place restarts before the pod fails.")

    @model_validator(mode="after")
    def _order(self) -> Elastic:
        if self.min_nodes > self.max_nodes:
            raise ValueError("minNodes must not exceed maxNodes")
        return self


class VolumeClaim(ApiModel):
    """A PersistentVolumeClaim the operator creates for checkpoints."""

    size: Quantity = _quantity_field("Requested storage, e.g. 500Gi.", default="10Gi")
    storage_class_name: str | None = Field(None, max_length=253, description="StorageClass; unset uses the default.")
    access_modes: list[Literal["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"]] = Field(
        default_factory=lambda: ["ReadWriteMany"],
        min_length=1,
        max_length=3,
        description="Multi-node jobs need ReadWriteMany: every node writes its own shards.",
    )
    retain_on_delete: bool = Field(True, description="Keep the claim (and the checkpoints) when the job is deleted.")


class Checkpoint(CheckpointPolicy):
    """Checkpoint storage (an existing claim or one to create) plus the trainer's save policy."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _rule(
                    "has(self.existingClaim) != has(self.volumeClaim)",
                    "set exactly one of existingClaim (a PVC you made) or volumeClaim (one to create)",
                )
            ]
        }
    )
    existing_claim: str | None = Field(
        None,
        max_length=253,
        description="Name of an existing PersistentVolumeClaim to store checkpoints in.",
        json_schema_extra=_immutable("checkpoint.existingClaim"),
    )
    volume_claim: VolumeClaim | None = Field(
        None,
        description="Create a PVC named <job>-checkpoints.",
        json_schema_extra=_immutable("checkpoint.volumeClaim"),
    )
    mount_path: str = Field(
        "/checkpoints", pattern=r"^/.*", max_length=1024, description="Where the claim is mounted in each pod."
    )
    sub_path: str | None = Field(
        None, max_length=1024, description="Directory inside the claim; default is the job's name."
    )

    @model_validator(mode="after")
    def _one_claim(self) -> Checkpoint:
        if (self.existing_claim is None) == (self.volume_claim is None):
            raise ValueError("set exactly one of existingClaim (a PVC you made) or volumeClaim (one to create)")
        return self


ExitCode = Annotated[int, Field(ge=0, le=255)]


class FailurePolicy(ApiModel):
    """When a failure restarts the gang and when it ends the job."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _rule(
                    "!has(self.permanentExitCodes) || !has(self.retryableExitCodes) || "
                    "self.permanentExitCodes.all(c, !(c in self.retryableExitCodes))",
                    "an exit code cannot be both retryable and permanent",
                )
            ]
        }
    )
    backoff_limit: int = Field(3, ge=0, le=1000, description="Gang restarts allowed before the job fails.")
    permanent_exit_codes: list[ExitCode] = Field(
        [2],  # pydantic copies mutable defaults per instance; a literal also lands in the CRD's schema
        max_length=256,
        description="Exit codes that fail the job at once (2: invalid trainer config).",
    )
    retryable_exit_codes: list[ExitCode] | None = Field(
        None,
        max_length=256,
        description="If set, only these exit codes (and evictions / node loss) restart the gang; others fail it.",
    )
    hang_timeout_seconds: int | None = Field(
        None, ge=60, le=604800, description="Restart the gang when training reports no progress for this long."
    )

    @model_validator(mode="after")
    def _disjoint(self) -> FailurePolicy:
        if self.retryable_exit_codes and set(self.retryable_exit_codes) & set(self.permanent_exit_codes):
            raise ValueError("an exit code cannot be both retryable and permanent")
        return self


class RunPolicy(ApiModel):
    """Job-level lifetime controls, as in Kubernetes Jobs."""

    suspend: bool = Field(False, description="Delete the pods (after a final checkpoint) and keep the job.")
    active_deadline_seconds: int | None = Field(
        None, ge=1, description="Fail the job when it has been active this long."
    )
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, description="Delete the job this long after it succeeded or failed."
    )
    clean_pod_policy: Literal["None", "Running", "All"] = Field(
        "Running", description="Pods deleted when the job ends: None, Running (still running ones) or All."
    )


class Gang(ApiModel):
    """All-or-nothing scheduling through a PodGroup."""

    enabled: bool = Field(False, description="Create a PodGroup so the gang is scheduled all at once.")
    provider: Literal["volcano", "scheduler-plugins"] = Field(
        "scheduler-plugins", description="Whose PodGroup API to use."
    )
    schedule_timeout_seconds: int = Field(300, ge=1, description="scheduler-plugins: give up after this long.")


class Scheduling(ApiModel):
    """Where pods may run."""

    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pods require.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Pod tolerations.")
    affinity: dict[str, Any] | None = Field(None, description="Pod affinity (a core/v1 Affinity).")
    priority_class_name: str | None = Field(None, max_length=253, description="PriorityClass of the pods.")
    scheduler_name: str | None = Field(None, max_length=253, description="Scheduler of the pods.")
    queue_name: str | None = Field(
        None, max_length=63, description="Kueue LocalQueue; sets the kueue.x-k8s.io/queue-name label."
    )
    gang: Gang = Field(default_factory=Gang, description="Gang scheduling.")


class EnvVar(ApiModel):
    """An environment variable for the trainer container."""

    name: str = Field(..., min_length=1, max_length=256, description="Variable name.")
    value: str | None = Field(None, description="Literal value.")
    value_from: dict[str, Any] | None = Field(None, description="A core/v1 EnvVarSource.")


_ENV_RULE = (
    "self.all(e, !e.name.startsWith('"
    + RESERVED_ENV_PREFIX
    + "') && !(e.name in "
    + str(list(RESERVED_ENV)).replace('"', "'")
    + "))"
)


class PodOverrides(ApiModel):
    """Additions to every pod of the job."""

    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=256,
        description="Extra environment. Rendezvous variables (PET_*, MASTER_ADDR, WORLD_SIZE, ...) are the "
        "operator's and are refused.",
        json_schema_extra={
            "x-kubernetes-validations": [
                _rule(
                    _ENV_RULE,
                    "pod.env must not set PET_* or "
                    + ", ".join(RESERVED_ENV)
                    + ": the operator sets them for the rendezvous",
                )
            ]
        },
    )
    volumes: list[dict[str, Any]] = Field(default_factory=list, description="Extra core/v1 Volumes.")
    volume_mounts: list[dict[str, Any]] = Field(default_factory=list, description="Extra VolumeMounts.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra pod annotations.")
    labels: dict[str, str] = Field(default_factory=dict, description="Extra pod labels.")
    service_account_name: str | None = Field(None, max_length=253, description="ServiceAccount of the pods.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        None, description="Image pull policy of the trainer container."
    )

    @field_validator("env")
    @classmethod
    def _no_reserved(cls, env: list[EnvVar]) -> list[EnvVar]:
        for e in env:
            if e.name.startswith(RESERVED_ENV_PREFIX) or e.name in RESERVED_ENV:
                raise ValueError(
                    f"pod.env must not set {e.name}: the operator sets PET_* and {', '.join(RESERVED_ENV)}"
                )
        return env


_PROCS_SCHEMA = {
    "x-kubernetes-int-or-string": True,
    "x-kubernetes-validations": [
        _rule(
            "type(self) == int ? (self >= 1 && self <= 64) : self == 'auto'",
            "procsPerNode must be 'auto' or a number from 1 to 64",
        ),
        _rule("self == oldSelf", "procsPerNode is immutable after creation"),
    ],
}


@dataclass(frozen=True)
class CrossFieldRule:
    """One constraint across spec fields, written once: CEL for admission, Python for the operator."""

    field: str  # path under spec the error is reported at
    message: str
    cel: str  # evaluated with self = spec
    holds: Callable[[ShardedTrainingJobSpec], bool]


CROSS_FIELD_RULES = [
    CrossFieldRule(
        "nodes",
        "must lie between elastic.minNodes and elastic.maxNodes",
        "!has(self.elastic) || (self.elastic.minNodes <= self.nodes && self.nodes <= self.elastic.maxNodes)",
        lambda s: not s.elastic or s.elastic.min_nodes <= s.nodes <= s.elastic.max_nodes,
    ),
    CrossFieldRule(
        "network.infiniband.enabled",
        "InfiniBand needs GPUs: set resources.gpusPerNode > 0 or disable network.infiniband",
        "!has(self.network) || !has(self.network.infiniband) || !self.network.infiniband.enabled || "
        "(has(self.resources) && self.resources.gpusPerNode > 0)",
        lambda s: not s.network.infiniband.enabled or s.resources.gpus_per_node > 0,
    ),
    CrossFieldRule(
        "network.backend",
        "nccl needs GPUs: set resources.gpusPerNode > 0 or use backend auto or gloo",
        "!has(self.network) || !has(self.network.backend) || self.network.backend != 'nccl' || "
        "(has(self.resources) && self.resources.gpusPerNode > 0)",
        lambda s: s.network.backend != "nccl" or s.resources.gpus_per_node > 0,
    ),
    CrossFieldRule(
        "procsPerNode",
        "exceeds resources.gpusPerNode: each process needs a GPU of its own",
        "!has(self.procsPerNode) || type(self.procsPerNode) != int || !has(self.resources) || "
        "self.resources.gpusPerNode == 0 || self.procsPerNode <= self.resources.gpusPerNode",
        lambda s: (
            not isinstance(s.procs_per_node, int)
            or s.resources.gpus_per_node == 0
            or s.procs_per_node <= s.resources.gpus_per_node
        ),
    ),
    CrossFieldRule(
        "trainer.precision",
        "fp16 needs a loss scaler that FSDP2 does not provide: use bf16, or strategy.type zero2",
        "!has(self.strategy) || !has(self.strategy.type) || self.strategy.type != 'fsdp' || "
        "!has(self.trainer) || !has(self.trainer.precision) || self.trainer.precision != 'fp16'",
        lambda s: not (s.strategy.type == "fsdp" and s.trainer.precision == "fp16"),
    ),
    CrossFieldRule(
        "checkpoint.async",
        "asynchronous saves are supported for strategy.type fsdp only",
        "!has(self.checkpoint) || !has(self.checkpoint.async) || !self.checkpoint.async || "
        "!has(self.strategy) || !has(self.strategy.type) || self.strategy.type == 'fsdp'",
        lambda s: not (s.checkpoint and s.checkpoint.async_save and s.strategy.type != "fsdp"),
    ),
    CrossFieldRule(
        "scheduling.gang.enabled",
        "gang scheduling cannot be combined with elastic: a gang has a fixed size",
        "!has(self.scheduling) || !has(self.scheduling.gang) || !self.scheduling.gang.enabled || !has(self.elastic)",
        lambda s: not (s.scheduling.gang.enabled and s.elastic),
    ),
]

_SPEC_RULES = [
    _rule(
        "!has(oldSelf.strategy) || !has(self.strategy) || !has(oldSelf.strategy.type) || "
        "!has(self.strategy.type) || self.strategy.type == oldSelf.strategy.type",
        "strategy.type is immutable after creation: FSDP and ZeRO-2 checkpoints are not interchangeable",
        field_path=".strategy.type",
    ),
    *(_rule(r.cel, r.message, field_path="." + r.field) for r in CROSS_FIELD_RULES),
]


class ShardedTrainingJobSpec(ApiModel):
    """Desired state of a ShardedTrainingJob: nodes x processes training one model with FSDP2 or ZeRO-2."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _SPEC_RULES})

    nodes: int = Field(1, ge=1, le=1024, description="Pods (one torchrun agent each, one per node).")
    procs_per_node: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        "auto",
        description="Processes per pod: 'auto' = resources.gpusPerNode, or 2 on CPU. WORLD_SIZE = nodes x this.",
        json_schema_extra=_PROCS_SCHEMA,
    )
    image: str = Field(..., min_length=1, max_length=1024, description="Trainer image (has torchrun and the trainer).")
    strategy: StrategyConfig = Field(
        default_factory=StrategyConfig, description="The one switch between FSDP2 and ZeRO-2, with each one's options."
    )
    trainer: TrainingSpec = Field(default_factory=TrainingSpec, description="Model, data and optimisation.")
    command: list[str] | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="Run this script (and arguments) under torchrun instead of the bundled trainer; the trainer "
        "config is still mounted at /etc/sharded/trainer.yaml.",
    )
    resources: Resources = Field(default_factory=Resources, description="Per-pod resources.")
    shm_size: Quantity | None = _quantity_field(
        "Size of the memory-backed /dev/shm; default is half of resources.memory, or 2Gi."
    )
    network: Network = Field(default_factory=Network, description="Backend and networking.")
    rendezvous: Rendezvous = Field(default_factory=Rendezvous, description="torchrun c10d rendezvous.")
    elastic: Elastic | None = Field(None, description="Elastic min:max nodes; unset means exactly `nodes`.")
    checkpoint: Checkpoint | None = Field(None, description="Checkpoint storage and policy; unset disables.")
    failure_policy: FailurePolicy = Field(default_factory=FailurePolicy, description="Restart policy.")
    run_policy: RunPolicy = Field(default_factory=RunPolicy, description="Suspend, deadlines, TTL, cleanup.")
    scheduling: Scheduling = Field(default_factory=Scheduling, description="Placement and gang scheduling.")
    pod: PodOverrides = Field(default_factory=PodOverrides, description="Additions to every pod.")

    @model_validator(mode="after")
    def _cross_field(self) -> ShardedTrainingJobSpec:
        broken = [f"{r.field}: {r.message}" for r in CROSS_FIELD_RULES if not r.holds(self)]
        if broken:
            raise ValueError("; ".join(broken))
        return self


# --- status -------------------------------------------------------------------------------------

Phase = Literal["Pending", "Starting", "Running", "Restarting", "Succeeded", "Failed", "Suspended"]


class Condition(ApiModel):
    """A Kubernetes-style condition."""

    model_config = ConfigDict(extra="ignore")
    type: str = Field(..., description="Created, Running, Restarting, Succeeded, Failed or Suspended.")
    status: Literal["True", "False", "Unknown"] = Field(..., description="True, False or Unknown.")
    reason: str = Field("", description="CamelCase reason for the last transition.")
    message: str = Field("", description="Human-readable detail.")
    last_transition_time: str | None = Field(None, description="When status last changed (RFC 3339).")


class Progress(ApiModel):
    """Training progress reported by rank 0."""

    model_config = ConfigDict(extra="ignore")
    step: int = Field(0, description="Last completed optimizer step.")
    total_steps: int | None = Field(None, description="Steps the job trains for.")
    loss: float | None = Field(None, description="Loss at `step`.")
    tokens_per_second: float | None = Field(None, description="Throughput over all processes.")
    mfu: float | None = Field(None, description="Model FLOPs utilisation (GPU runs).")
    updated_at: str | None = Field(None, description="When rank 0 reported this (RFC 3339).")


class CheckpointStatus(ApiModel):
    """The newest complete checkpoint."""

    model_config = ConfigDict(extra="ignore")
    step: int = Field(..., description="Step the checkpoint holds.")
    path: str = Field(..., description="Directory of the checkpoint inside the claim.")
    time: str | None = Field(None, description="When it was committed (RFC 3339).")


class FailureInfo(ApiModel):
    """The last failure that ended an attempt."""

    model_config = ConfigDict(extra="ignore")
    pod: str | None = Field(None, description="Failed pod.")
    node: str | None = Field(None, description="Kubernetes node the pod ran on.")
    node_rank: int | None = Field(None, description="The pod's torchrun node rank.")
    exit_code: int | None = Field(None, description="Exit code of the trainer container.")
    reason: str = Field(..., description="e.g. Error, OOMKilled, Evicted, NodeLost, Hang, InvalidSpec.")
    message: str = Field("", description="Detail.")
    attempt: int | None = Field(None, description="Attempt that failed.")
    time: str | None = Field(None, description="When it was observed (RFC 3339).")


class ShardedTrainingJobStatus(ApiModel):
    """Observed state of a ShardedTrainingJob."""

    model_config = ConfigDict(extra="ignore")
    phase: Phase | None = Field(
        None, description="Pending, Starting, Running, Restarting, Succeeded, Failed, Suspended."
    )
    message: str | None = Field(None, description="Why the job is in this phase.")
    conditions: list[Condition] = Field(default_factory=list, description="Kubernetes-style conditions.")
    ready: str | None = Field(None, description="Running pods / nodes, e.g. 3/4.")
    ready_nodes: int = Field(0, description="Pods of the current attempt that are running.")
    attempt: int = Field(0, description="Current attempt (a fresh gang and rendezvous id each).")
    restarts: int = Field(0, description="Gang restarts so far (counted against backoffLimit).")
    progress: Progress | None = Field(None, description="Live training progress.")
    last_checkpoint: CheckpointStatus | None = Field(None, description="Newest complete checkpoint.")
    last_failure: FailureInfo | None = Field(None, description="Last failure that ended an attempt.")
    start_time: str | None = Field(None, description="When the job first started (RFC 3339).")
    completion_time: str | None = Field(None, description="When the job succeeded or failed (RFC 3339).")
    observed_generation: int | None = Field(None, description="metadata.generation the status reflects.")


class ShardedTrainingJob(BaseModel):
    """A whole object as read from the API server."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")
    api_version: str = Field(f"{GROUP}/{VERSION}", alias="apiVersion")
    kind: str = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: ShardedTrainingJobSpec
    status: ShardedTrainingJobStatus = Field(default_factory=ShardedTrainingJobStatus)


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Ready", "type": "string", "jsonPath": ".status.ready"},
    {"name": "Strategy", "type": "string", "jsonPath": ".spec.strategy.type"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
    {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss", "priority": 1},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
    {"name": "Checkpoint", "type": "integer", "jsonPath": ".status.lastCheckpoint.step"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

ROOT_RULES = [
    _rule(
        f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
        f"metadata.name must be at most {MAX_NAME_LENGTH} characters: pods are named <name>-<index> and "
        "used as 63-character hostnames",
    ),
    _rule(
        f"self.metadata.name.matches('{NAME_PATTERN}')",
        "metadata.name must be a DNS label starting with a letter (a-z, 0-9, '-'): it names the headless Service",
    ),
]
