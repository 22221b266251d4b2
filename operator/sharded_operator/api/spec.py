"""The parts of a ShardedTrainingJob's spec: resources, networking, storage, policies, scheduling
(what a job adds to its pods is in `pods`).

Each model's fields document themselves in the CRD; each model's `rules` become its CEL validations
and are checked again in Python (see `sharded_api.rules`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from sharded_api.cel import At, Has
from sharded_api.config import CheckpointPolicy, Model
from sharded_api.contract import DEFAULT_RDZV_TIMEOUT_SECONDS, ExitCode
from sharded_api.quantity import is_quantity, quantity_value
from sharded_api.rules import Rule


def _immutable(what: str) -> dict:
    return {"x-kubernetes-validations": [{"rule": "self == oldSelf", "message": f"{what} is immutable after creation"}]}


# One rule for every quantity field, in both worlds: the API server's isQuantity and our port of it. The
# sign is read off the text: quantity arithmetic in CEL on an admissible "1e9999999999" runs until the
# request times out.
_QUANTITY_MESSAGE = "must be a non-negative Kubernetes quantity such as 16Gi, 500m or 4"
_QUANTITY_CEL = "type(self) == int ? self >= 0 : (isQuantity(self) && !self.startsWith('-'))"


def _quantity_field(description: str, default: str | None = None) -> Any:
    return Field(
        default,
        description=description,
        json_schema_extra={
            "x-kubernetes-int-or-string": True,
            "x-kubernetes-validations": [{"rule": _QUANTITY_CEL, "message": _QUANTITY_MESSAGE}],
        },
    )


def _check_quantity(v: int | str) -> int | str:
    if (isinstance(v, int) and v >= 0) or (isinstance(v, str) and is_quantity(v) and not v.startswith("-")):
        return v
    raise ValueError(_QUANTITY_MESSAGE)


Quantity = Annotated[int | str, AfterValidator(_check_quantity)]


class ApiModel(Model):
    """Base of the CRD models; same camelCase and strictness as the trainer config."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


def _limit_rule(resource: str) -> dict[str, str]:
    """limit >= request, in CEL. quantity() is compared only on plain decimal forms: CEL's quantity arithmetic on
    an admissible exponent such as 1e9999999999 runs until the request times out. The operator checks any form."""
    limit, plain = f"{resource}Limit", "'^[0-9]+([.][0-9]+)?[a-zA-Z]{0,2}$'"
    return {
        "rule": f"!has(self.{limit}) || !has(self.{resource}) || !string(self.{resource}).matches({plain}) || "
        f"!string(self.{limit}).matches({plain}) || "
        f"quantity(string(self.{limit})).compareTo(quantity(string(self.{resource}))) >= 0",
        "message": f"{limit} must be at least {resource} (the request)",
    }


class Resources(ApiModel):
    """Per-pod compute resources (one pod per node)."""

    raw_rules = (_limit_rule("cpu"), _limit_rule("memory"))

    gpus_per_node: int = Field(0, ge=0, le=64, description="GPUs requested by each pod; 0 runs on CPU with gloo.")
    gpu_resource_name: str = Field(
        "nvidia.com/gpu", max_length=253, description="Extended resource name of a GPU on your nodes."
    )
    cpu: Quantity | None = _quantity_field("CPU request of each pod (its limit too, unless cpuLimit), e.g. 32, 1500m.")
    memory: Quantity | None = _quantity_field("Memory request of each pod (its limit too unless memoryLimit): 8Gi.")
    cpu_limit: Quantity | None = _quantity_field(
        "CPU limit above the request (Burstable QoS): the pods may use idle CPU, e.g. for data loading. Unset: the "
        "limit is the request (Guaranteed QoS, what training usually wants)."
    )
    memory_limit: Quantity | None = _quantity_field("Memory limit above the request. Unset: the request.")

    @model_validator(mode="after")
    def _limits_cover_requests(self) -> Resources:
        for name, request, limit in (("cpu", self.cpu, self.cpu_limit), ("memory", self.memory, self.memory_limit)):
            if request is not None and limit is not None and quantity_value(limit) < quantity_value(request):
                raise ValueError(f"{name}Limit must be at least {name} (the request)")
        return self


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


class Networking(ApiModel):
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
    """torchrun's c10d rendezvous, through a store in a pod of its own (<job>-rdzv), not in a training pod."""

    port: int = Field(29400, ge=1024, le=65535, description="TCP port of the rendezvous store pod.")
    timeout_seconds: int = Field(
        DEFAULT_RDZV_TIMEOUT_SECONDS,
        ge=30,
        le=86400,
        description="How long agents wait for every node to join before failing.",
    )
    last_call_seconds: int = Field(
        5,
        ge=1,
        le=600,
        description="With elastic: how long a round that has minNodes waits for more nodes before it starts "
        "(torchrun's own default of 30 s would stall every recovery).",
    )


class Elastic(ApiModel):
    """Elastic membership: the gang may run with between minNodes and maxNodes nodes."""

    rules = (
        Rule(
            "minNodes", "must not exceed maxNodes", At("minNodes").le(At("maxNodes")),
            good=({"minNodes": 2, "maxNodes": 2},), bad=({"minNodes": 3, "maxNodes": 2},),
        ),
    )  # fmt: skip
    min_nodes: int = Field(..., ge=1, le=1024, description="Fewest nodes training may continue with.")
    max_nodes: int = Field(..., ge=1, le=1024, description="Most nodes the job may use.")
    max_restarts: int = Field(3, ge=0, le=100, description="torchrun's in-place restarts before the pod fails.")
    keep_global_batch: bool = Field(
        True,
        strict=True,  # as the schema's boolean: "yes" or 1 is refused, not read as true
        description="Keep the batch of maxNodes nodes at every size (gradient accumulation makes up for the "
        "missing nodes, the nearest batch when it does not divide), so the loss curve goes on across resizes. "
        "trainer.globalBatchSize, when set, is kept instead. false: each node adds its own batch.",
    )


class Interactive(ApiModel):
    """An interactive job: its pods start with every rendezvous variable set but train nothing by themselves."""

    port: int = Field(
        8888,
        ge=1024,
        le=65535,
        description="JupyterLab's port on node 0, bound to the pod's loopback: reached through the API server only "
        "(`sharded port-forward NAME PORT`), with the token node 0 prints in its log.",
    )


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

    rules = (
        Rule(
            "", "set exactly one of existingClaim (a PVC you made) or volumeClaim (one to create)",
            Has("existingClaim").ne(Has("volumeClaim")),
            good=({"existingClaim": "mine", "volumeClaim": None},),
            bad=({"existingClaim": "mine"}, {"volumeClaim": None}),
        ),
    )  # fmt: skip
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


ExitCodeValue = Annotated[int, Field(ge=0, le=255)]


class FailurePolicy(ApiModel):
    """When a failure restarts the gang and when it ends the job."""

    rules = (
        Rule(
            "retryableExitCodes", "an exit code cannot be both retryable and permanent",
            Has("retryableExitCodes").implies(At("permanentExitCodes").disjoint(At("retryableExitCodes"))),
            good=({"retryableExitCodes": [1, 137]}, {"permanentExitCodes": [1], "retryableExitCodes": [2]}),
            bad=({"retryableExitCodes": [1, 2]}, {"permanentExitCodes": [1, 7], "retryableExitCodes": [7]}),
        ),
    )  # fmt: skip
    backoff_limit: int = Field(3, ge=0, le=1000, description="Gang restarts allowed before the job fails.")
    in_place_restarts: int = Field(
        0, ge=0, le=100,
        description="Worker restarts inside the running pods before a failure restarts the gang: when a trainer "
        "process fails, torchrun restarts every node's workers at a new rendezvous round, which resume from the "
        "newest checkpoint, and no pod is recreated. A pod that fails or is lost is replaced alone and joins the "
        "next round (status.podReplacements), at most this many times per attempt. Counted in "
        "status.inPlaceRestarts, not against backoffLimit. With elastic, elastic.maxRestarts applies instead.",
    )  # fmt: skip
    in_place_timeout_seconds: int = Field(
        300,
        ge=10,
        le=86400,
        description="How long training may take to resume after a pod was replaced alone (the replacement "
        "scheduled, started and joined, a new trainer process reporting) before the gang restarts as a new attempt.",
    )
    permanent_exit_codes: list[ExitCodeValue] = Field(
        # pydantic copies mutable defaults per instance; a literal lands in the CRD
        [int(ExitCode.INVALID_CONFIG), int(ExitCode.INCOMPATIBLE_CHECKPOINT)],
        max_length=256,
        description="Exit codes that fail the job at once (2: invalid trainer config; 4: the newest checkpoint was "
        "written for another model or layout).",
    )
    retryable_exit_codes: list[ExitCodeValue] | None = Field(
        None,
        max_length=256,
        description="If set, only these exit codes (and evictions / node loss) restart the gang; others fail it.",
    )
    hang_timeout_seconds: int | None = Field(
        None,
        ge=60,
        le=604800,
        description="Restart the gang when the current attempt, having reported progress, sends no new report for "
        "this long (the operator's clock). An attempt that never reports is never declared hung.",
    )
    startup_timeout_seconds: int | None = Field(
        None,
        ge=60,
        le=604800,
        description="Restart the gang when no progress report arrives this long after every pod is running.",
    )
    scheduling_timeout_seconds: int | None = Field(
        None,
        ge=1,
        le=604800,
        description="Raise the PodsStuck condition and an event when a pod stays unschedulable or cannot pull its "
        "image for this long (the reason shows in status at once). Unset: wait quietly, as a job queued by Kueue or "
        "a gang scheduler should.",
    )
    node_lost_seconds: int = Field(
        60,
        ge=10,
        le=3600,
        description="A node whose Ready condition has been False or Unknown this long is lost: its pods' attempt "
        "restarts elsewhere, and its pods still terminating after their grace are force-deleted.",
    )
    count_disruptions: bool = Field(
        False,
        description="Count disruptions (evictions, preemption, node loss, a stop after a final checkpoint) against "
        "backoffLimit; by default they restart the gang without using it.",
    )


class RunPolicy(ApiModel):
    """Job-level lifetime controls, as in Kubernetes Jobs."""

    suspend: bool = Field(False, description="Delete the pods (after a final checkpoint) and keep the job.")
    active_deadline_seconds: int | None = Field(
        None, ge=1, description="Fail the job when it has been active this long; the timer restarts on resume."
    )
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, description="Delete the job this long after it succeeded or failed."
    )
    termination_grace_seconds: int | None = Field(
        None,
        ge=0,
        le=86400,
        description="The pods' grace period: how long the trainer has for its final checkpoint when a pod is "
        "stopped (suspend, eviction, drain). Unset uses the operator's default (suspendGraceSeconds).",
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
    queue: str | None = Field(
        None,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="volcano: the Volcano Queue the PodGroup joins (unset: the scheduler's default queue).",
    )

    rules = (
        Rule(
            "queue", "is a Volcano Queue: set provider: volcano, or leave queue out",
            Has("queue").implies(At("provider").eq("volcano")),
            good=({"provider": "volcano", "queue": "research"}, {"provider": "scheduler-plugins"}),
            bad=({"provider": "scheduler-plugins", "queue": "research"},),
        ),
    )  # fmt: skip


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


PROCS_SCHEMA = {
    "x-kubernetes-int-or-string": True,
    "x-kubernetes-validations": [
        {
            "rule": "type(self) == int ? (self >= 1 && self <= 64) : self == 'auto'",
            "message": "procsPerNode must be 'auto' or a number from 1 to 64",
        },
        {"rule": "self == oldSelf", "message": "procsPerNode is immutable after creation"},
    ],
}
