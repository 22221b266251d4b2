"""The ShardedTrainingJob API: names, the spec and status models, the single source of the CRD in crds/.

Field descriptions become the CRD's OpenAPI descriptions (`kubectl explain stj.spec`); each model's
`rules` become admission-time CEL rules and are checked again in Python with the same wording, so an
object that slipped past admission (an older CRD, say) fails with the same message instead of
reaching a pod. The parts of the spec live in `spec`, the status in `status`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field

from sharded_api.cel import At, Has
from sharded_api.config import TrainerConfig, TrainingSpec
from sharded_api.contract import DEFAULT_CONFIG_PATH, WorkerEnv
from sharded_api.rules import Rule, Ruled
from sharded_api.strategy import StrategyConfig
from sharded_operator.api.pods import TRAINER_CONTAINER, PodOverrides
from sharded_operator.api.spec import (
    PROCS_SCHEMA,
    ApiModel,
    Checkpoint,
    Elastic,
    FailurePolicy,
    Interactive,
    Networking,
    Quantity,
    Rendezvous,
    Resources,
    RunPolicy,
    Scheduling,
    _quantity_field,
)
from sharded_operator.api.status import ShardedTrainingJobStatus

GROUP = "training.sharded.dev"
VERSION = "v1alpha1"
KIND = "ShardedTrainingJob"
PLURAL = "shardedtrainingjobs"
SHORT_NAME = "stj"
# Labels on every child of a job: which job, which node of the gang, which attempt created it.
LABEL_JOB = f"{GROUP}/job-name"
LABEL_INDEX = f"{GROUP}/node-index"
LABEL_ATTEMPT = f"{GROUP}/attempt"
LABEL_ROLE = f"{GROUP}/role"  # set on the rendezvous store pod only: training pods carry a node index instead
ROLE_RENDEZVOUS = "rendezvous"
STORE_CONTAINER = "rendezvous"


def training_pods(job: str) -> str:
    """Label selector of a job's training pods (those with a node index), not its rendezvous store pod."""
    return f"{LABEL_JOB}={job},{LABEL_INDEX}"


# On the checkpoint claim, which outlives its job when retained: the UID of the job that created it.
ANNOTATION_CREATED_BY = f"{GROUP}/created-by-uid"
CONTAINER = TRAINER_CONTAINER  # the trainer's container in every pod
# Pods are named <job>-<index> and double as hostnames (63-character DNS labels); PVCs <job>-checkpoints.
MAX_NAME_LENGTH = 50
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

_GPUS = At("resources.gpusPerNode")
_TRAINER_ROOTS = {"precision": "trainer.precision", "lora": "trainer.lora", "model": "trainer.model"}
SPEC_RULES = (
    Rule(
        "nodes", "must lie between elastic.minNodes and elastic.maxNodes",
        Has("elastic").implies(At("elastic.minNodes").le(At("nodes")) & At("nodes").le(At("elastic.maxNodes"))),
        good=({"nodes": 2, "elastic": {"minNodes": 1, "maxNodes": 2}},),
        bad=(
            {"nodes": 3, "elastic": {"minNodes": 1, "maxNodes": 2}},
            {"nodes": 1, "elastic": {"minNodes": 2, "maxNodes": 4}},
        ),
    ),
    Rule(
        "network.infiniband.enabled",
        "InfiniBand needs GPUs: set resources.gpusPerNode > 0 or disable network.infiniband",
        At("network.infiniband.enabled").implies(_GPUS.gt(0)),
        good=({"network": {"infiniband": {"enabled": True}}, "resources": {"gpusPerNode": 8}},),
        bad=({"network": {"infiniband": {"enabled": True}}},),
    ),
    Rule(
        "network.backend", "nccl needs GPUs: set resources.gpusPerNode > 0 or use backend auto or gloo",
        At("network.backend").ne("nccl") | _GPUS.gt(0),
        good=({"network": {"backend": "nccl"}, "resources": {"gpusPerNode": 2}},),
        bad=({"network": {"backend": "nccl"}},),
    ),
    Rule(
        "procsPerNode", "exceeds resources.gpusPerNode: each process needs a GPU of its own",
        (At("procsPerNode").is_int() & _GPUS.gt(0)).implies(At("procsPerNode").le(_GPUS)),
        good=({"procsPerNode": 4, "resources": {"gpusPerNode": 4}}, {"procsPerNode": 8}),
        bad=({"procsPerNode": 8, "resources": {"gpusPerNode": 4}},),
    ),
    # TrainerConfig's own rules (TrainingSpec's hold under spec.trainer already), on the job's paths.
    # An NF4 base needs GPUs (a rule below): the examples have them.
    *(r.rebased(_TRAINER_ROOTS, context={"resources": {"gpusPerNode": 8}})
      for r in TrainerConfig.rules if r not in TrainingSpec.rules),
    Rule(
        "trainer.exportOnSuccess", "needs spec.checkpoint and trainer.model.huggingface: the export is a Hugging "
        "Face directory written next to the checkpoints",
        At("trainer.exportOnSuccess").implies(Has("checkpoint") & Has("trainer.model.huggingface")),
        good=({"trainer": {"exportOnSuccess": True, "model": {"huggingface": {"path": "/m"}, "preset": None}},
               "checkpoint": {"volumeClaim": {"size": "1Gi"}}},),
        bad=({"trainer": {"exportOnSuccess": True, "model": {"huggingface": {"path": "/m"}, "preset": None}},
              "checkpoint": None},
             {"trainer": {"exportOnSuccess": True}, "checkpoint": {"volumeClaim": {"size": "1Gi"}}}),
    ),
    Rule(
        "trainer.lora.quantizeBase", "NF4 weights are for GPUs: set resources.gpusPerNode > 0, or remove "
        "quantizeBase to train the adapters over a bf16 base",
        Has("trainer.lora.quantizeBase").implies(_GPUS.gt(0)),
        good=({"trainer": {"lora": {"quantizeBase": "nf4"}, "model": {"huggingface": {"path": "/m"}, "preset": None}},
               "resources": {"gpusPerNode": 8}},),
        bad=({"trainer": {"lora": {"quantizeBase": "nf4"}, "model": {"huggingface": {"path": "/m"}, "preset": None}}},),
    ),
    Rule(
        "trainer.tensorboard", "needs spec.checkpoint: the event files are written next to the checkpoints",
        At("trainer.tensorboard").implies(Has("checkpoint")),
        good=({"trainer": {"tensorboard": True}, "checkpoint": {"volumeClaim": {"size": "1Gi"}}},),
        bad=({"trainer": {"tensorboard": True}, "checkpoint": None},),
    ),
    Rule(
        "scheduling.queueName",
        "Kueue admits a job as one workload of a fixed size: it cannot be combined with elastic",
        Has("scheduling.queueName").implies(~Has("elastic")),
        good=({"scheduling": {"queueName": "team-a"}}, {"elastic": {"minNodes": 1, "maxNodes": 2}}),
        bad=({"scheduling": {"queueName": "team-a"}, "elastic": {"minNodes": 1, "maxNodes": 2}},),
    ),
    Rule(
        "interactive", "runs JupyterLab instead of a script: remove spec.command (run it by hand from the session)",
        Has("interactive").implies(~Has("command")),
        good=({"interactive": {"port": 8888}}, {"command": ["train.py"]}),
        bad=({"interactive": {"port": 8888}, "command": ["train.py"]},),
    ),
    Rule(
        "interactive", "a session waits for a person, not for progress: remove failurePolicy.hangTimeoutSeconds and "
        "startupTimeoutSeconds, which would restart it between runs",
        Has("interactive").implies(
            ~Has("failurePolicy.hangTimeoutSeconds") & ~Has("failurePolicy.startupTimeoutSeconds")
        ),
        good=({"interactive": {}}, {"failurePolicy": {"hangTimeoutSeconds": 600}}),
        bad=({"interactive": {}, "failurePolicy": {"hangTimeoutSeconds": 600}},
             {"interactive": {}, "failurePolicy": {"startupTimeoutSeconds": 600}}),
    ),
)  # fmt: skip


class ShardedTrainingJobSpec(ApiModel):
    """Desired state of a ShardedTrainingJob: nodes x processes training one model with FSDP2 or ZeRO-2."""

    rules = SPEC_RULES
    # Transition rules need the old object, which only the API server has.
    transition_rules: ClassVar[tuple[dict, ...]] = (
        {
            "rule": "!has(oldSelf.strategy) || !has(self.strategy) || self.strategy.type == oldSelf.strategy.type",
            "message": "strategy.type is immutable after creation: FSDP and ZeRO-2 checkpoints are not interchangeable",
            "fieldPath": ".strategy.type",
        },
        {
            "rule": "self.nodes == oldSelf.nodes || (has(oldSelf.runPolicy) && oldSelf.runPolicy.suspend) "
            "|| (has(self.elastic) && has(oldSelf.elastic))",
            "message": "nodes can change only while the job is suspended (runPolicy.suspend: true) or, with elastic, "
            "within elastic.minNodes..maxNodes: a fixed-size gang has a fixed size",
            "fieldPath": ".nodes",
        },
    )

    nodes: int = Field(1, ge=1, le=1024, description="Pods (one torchrun agent each, one per node).")
    procs_per_node: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        "auto",
        description=f"Processes per pod: 'auto' = resources.gpusPerNode, or 2 on CPU. {WorkerEnv.WORLD_SIZE} = nodes x "
        "this.",
        json_schema_extra=PROCS_SCHEMA,
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
        f"config is still mounted at {DEFAULT_CONFIG_PATH}.",
    )
    interactive: Interactive | None = Field(
        None,
        description="Start the pods with every rendezvous variable set, JupyterLab on node 0 and an idle shell on the "
        "others, instead of training: run torchrun by hand across the nodes (`sharded exec`). The session ends, and "
        "the job succeeds, when JupyterLab on node 0 exits 0.",
    )
    resources: Resources = Field(default_factory=Resources, description="Per-pod resources.")
    shm_size: Quantity | None = _quantity_field(
        "Size of the memory-backed /dev/shm; default is half of resources.memory, or 2Gi."
    )
    network: Networking = Field(default_factory=Networking, description="Backend and networking.")
    rendezvous: Rendezvous = Field(default_factory=Rendezvous, description="torchrun c10d rendezvous.")
    elastic: Elastic | None = Field(None, description="Elastic min:max nodes; unset means exactly `nodes`.")
    checkpoint: Checkpoint | None = Field(None, description="Checkpoint storage and policy; unset disables.")
    failure_policy: FailurePolicy = Field(default_factory=FailurePolicy, description="Restart policy.")
    run_policy: RunPolicy = Field(default_factory=RunPolicy, description="Suspend, deadlines, TTL, cleanup.")
    scheduling: Scheduling = Field(default_factory=Scheduling, description="Placement and gang scheduling.")
    pod: PodOverrides = Field(default_factory=PodOverrides, description="Additions to every pod.")


class ShardedTrainingJob(Ruled):
    """A whole object as read from the API server."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")
    rules = (
        Rule(
            "", f"metadata.name must be at most {MAX_NAME_LENGTH} characters: pods are named <name>-<index> and "
            "used as 63-character hostnames",
            Has("metadata.name").implies(At("metadata.name").size().le(MAX_NAME_LENGTH)),
            good=({"metadata": {"name": "a" * MAX_NAME_LENGTH}},), bad=({"metadata": {"name": "a" * 51}},),
        ),
        Rule(
            "", "metadata.name must be a DNS label starting with a letter (a-z, 0-9, '-'): it names the headless "
            "Service",
            Has("metadata.name").implies(At("metadata.name").matches(NAME_PATTERN)),
            good=({"metadata": {"name": "llama-8b"}},), bad=({"metadata": {"name": "8b-llama"}},),
        ),
    )  # fmt: skip
    api_version: str = Field(f"{GROUP}/{VERSION}", alias="apiVersion")
    kind: str = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: ShardedTrainingJobSpec
    status: ShardedTrainingJobStatus = Field(default_factory=ShardedTrainingJobStatus)


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Ready", "type": "string", "jsonPath": ".status.ready"},
    {"name": "Nodes", "type": "integer", "jsonPath": ".status.currentNodes"},
    {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredNodes"},
    {"name": "Strategy", "type": "string", "jsonPath": ".spec.strategy.type"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
    {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss", "priority": 1},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
    {"name": "Checkpoint", "type": "integer", "jsonPath": ".status.lastCheckpoint.step"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]
