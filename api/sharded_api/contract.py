"""What the operator and the trainer must agree on, in one torch-free place: both sides import these names.

The pod environment the operator sets and the trainer reads, the names a user may not override, the
exit codes, where the trainer config is mounted, the checkpoint layout, the time format, and the
progress report rank 0 posts to the operator (validated there with the same model). Nothing here
imports torch, kopf or the Kubernetes client: an import-linter contract keeps it so.
"""

from __future__ import annotations

import datetime as dt
import re
from enum import IntEnum, StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

# --- the pod environment ------------------------------------------------------------------------


class PodEnv(StrEnum):
    """Variables in every training pod. The operator sets them; the launcher and the trainer read them."""

    # torchrun's own arguments (PET_<ARG>), and MASTER_* for custom scripts
    NNODES = "PET_NNODES"
    NPROC_PER_NODE = "PET_NPROC_PER_NODE"
    NODE_RANK = "PET_NODE_RANK"
    RDZV_BACKEND = "PET_RDZV_BACKEND"
    RDZV_ENDPOINT = "PET_RDZV_ENDPOINT"
    RDZV_ID = "PET_RDZV_ID"
    RDZV_CONF = "PET_RDZV_CONF"
    MAX_RESTARTS = "PET_MAX_RESTARTS"
    MASTER_ADDR = "MASTER_ADDR"
    MASTER_PORT = "MASTER_PORT"
    # who this pod trains for, and where it reports
    JOB_NAME = "SHARDED_JOB_NAME"
    JOB_NAMESPACE = "SHARDED_JOB_NAMESPACE"
    JOB_UID = "SHARDED_JOB_UID"
    ATTEMPT = "SHARDED_ATTEMPT"
    RDZV_TIMEOUT = "SHARDED_RDZV_TIMEOUT"  # seconds; DEFAULT_RDZV_TIMEOUT_SECONDS when unset
    PROGRESS_URL = "SHARDED_PROGRESS_URL"
    PROGRESS_TOKEN_FILE = "SHARDED_PROGRESS_TOKEN_FILE"  # the pod's projected token for the operator's audience
    CONTRACT_VERSION = "SHARDED_CONTRACT_VERSION"
    POD_NAME = "POD_NAME"
    NODE_NAME = "NODE_NAME"
    # set by the launcher for its workers: where each rank leaves its exit code
    EXIT_DIR = "SHARDED_EXIT_DIR"
    # how torchrun starts the trainer's workers: forkserver (default: forked with the imports done) or spawn
    WORKER_START = "SHARDED_WORKER_START"


# The launcher's mark in the exit directory that a SIGTERM its workers get is its own (the pod is stopping),
# not torchrun's restart of the workers.
STOPPING = "stopping"


class WorkerEnv(StrEnum):
    """Variables torchrun sets for each worker process it starts."""

    WORLD_SIZE = "WORLD_SIZE"
    RANK = "RANK"
    LOCAL_RANK = "LOCAL_RANK"
    NODE_RANK = "NODE_RANK"
    LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
    GROUP_RANK = "GROUP_RANK"
    RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # how many times torchrun has restarted the workers
    GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"  # nodes (agents) in this rendezvous round


# How long agents wait for every node to join a rendezvous round (spec.rendezvous.timeoutSeconds' default).
DEFAULT_RDZV_TIMEOUT_SECONDS = 900


class UserEnv(StrEnum):
    """Variables a user may set (in `spec.pod.env`, or around a local run) that the trainer reads."""

    # A GPU memory cap (`40Gi`) the allocator enforces and strategy auto plans for (a shared or smaller GPU).
    GPU_MEMORY_LIMIT = "SHARDED_GPU_MEMORY_LIMIT"
    # Where `sharded_trainer.job_config()` reads the config when no path is given.
    TRAINER_CONFIG = "SHARDED_TRAINER_CONFIG"
    # A local run's stand-in for the operator: rank 0 rewrites this JSON file with its progress.
    PROGRESS_FILE = "SHARDED_PROGRESS_FILE"


# Variables torchrun and the operator own; a user value would break the rendezvous.
RESERVED_ENV_PREFIX = "PET_"
RESERVED_ENV = (PodEnv.MASTER_ADDR.value, PodEnv.MASTER_PORT.value, *(v.value for v in WorkerEnv))


def is_reserved_env(name: str) -> bool:
    return name.startswith(RESERVED_ENV_PREFIX) or name in RESERVED_ENV


# --- exit codes and files -----------------------------------------------------------------------


class ExitCode(IntEnum):
    """The trainer's exit codes, as the launcher passes them on to the pod's container status."""

    OK = 0
    INVALID_CONFIG = 2  # the config failed validation: permanent by default in failurePolicy
    RENDEZVOUS_UNREACHABLE = 3  # the startup barrier gave up waiting for the rendezvous endpoint
    INCOMPATIBLE_CHECKPOINT = 4  # the newest checkpoint was written for another model or layout: permanent
    PREEMPTED = 75  # stopped by SIGTERM after committing a final checkpoint: resume me
    FENCED = 76  # a newer writer owns the checkpoints: this one stopped without committing
    # Between a worker and the launcher only, never a pod's: stopped at the step another node's SIGTERM set,
    # after the final checkpoint every rank took part in (see launch.record_exit).
    PEER_STOPPED = 77


CONFIG_DIR = "/etc/sharded"
CONFIG_FILE = "trainer.yaml"
DEFAULT_CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"

# A checkpoint is the directory <root>/step-<8 digits>; it counts once MARKER exists in it.
STEP_DIR_PREFIX = "step-"
_STEP_DIR = re.compile(rf"^{STEP_DIR_PREFIX}(\d{{8}})$")
MARKER = "COMMITTED"
TRAINER_STATE = "trainer.json"
# Writer generations on the claim: one empty file per training start, the newest owns the checkpoints.
FENCE_DIR = ".generations"
# A checkpoint that fails its checks or its load is renamed `step-NNNNNNNN.corrupt-g<generation>`: kept for
# inspection, never loaded, never counted among the kept ones.
CORRUPT_INFIX = ".corrupt-g"
# A save is written into `step-NNNNNNNN.g<generation>` and renamed to the step directory at its commit.
WRITING_INFIX = ".g"


def step_dir_name(step: int) -> str:
    return f"{STEP_DIR_PREFIX}{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a checkpoint directory's name, or None for anything else."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


# --- time ---------------------------------------------------------------------------------------

_ISO_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
ISO_PATTERN = r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$"


def iso(t: dt.datetime | None = None) -> str:
    """RFC 3339 in UTC at second precision, as Kubernetes writes times; now when `t` is None."""
    t = t or dt.datetime.now(dt.UTC)
    return t.astimezone(dt.UTC).strftime(_ISO_FORMAT)


def parse_iso(s: str | None) -> dt.datetime | None:
    """Any RFC 3339 time (`...Z`, or `+00:00` as the Kubernetes client writes them), in UTC."""
    if not s:
        return None
    t = dt.datetime.fromisoformat(s)
    return (t if t.tzinfo else t.replace(tzinfo=dt.UTC)).astimezone(dt.UTC)


# --- the progress report ------------------------------------------------------------------------

# 2: StepProgress.mfu_6n beside mfu (the FLOPs done).
# 3: StepProgress.reward_accuracy, reward_margin, chosen_reward, rejected_reward (preference training).
CONTRACT_VERSION = 3
# Report versions this release reads. A newer trainer talking to an older operator is refused with a
# message naming these, rather than misread.
SUPPORTED_VERSIONS = frozenset({1, 2, 3})
MAX_EVENTS = 32  # newest trainer events a report carries; older ones were sent in earlier reports
MAX_REPORT_BYTES = 16 * 1024  # the operator refuses a larger body; the reporter leaves old events out to fit
# The pod's projected ServiceAccount token for the operator's audience, refreshed by the kubelet.
PROGRESS_TOKEN_DIR = "/var/run/secrets/training.sharded.dev/progress"
PROGRESS_TOKEN_FILE = "token"

IsoTime = Annotated[str, Field(pattern=ISO_PATTERN, max_length=20, description="RFC 3339 time in UTC.")]
Finite = Annotated[float, Field(allow_inf_nan=False, ge=-1e12, le=1e12)]
Step = Annotated[int, Field(ge=0, le=100_000_000)]


class Wire(BaseModel):
    """camelCase on the wire, unknown keys refused: within one version both sides know every key."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class CheckpointRef(Wire):
    """A committed checkpoint: its step, its directory and when it was committed."""

    step: Step = Field(..., description="Step the checkpoint holds.")
    path: str = Field(..., min_length=1, max_length=1024, description="Its directory, as the pods see it.")
    time: IsoTime | None = Field(None, description="When it was committed.")


class TrainerEventType(StrEnum):
    """What the trainer tells the operator besides progress; each becomes a Kubernetes event."""

    CHECKPOINT_COMMITTED = "CheckpointCommitted"
    CHECKPOINT_SET_ASIDE = "CheckpointSetAside"  # a checkpoint that cannot be loaded was skipped
    RESUMED = "ResumedFromCheckpoint"
    EXPORT_WRITTEN = "ExportWritten"
    SETTING_CHOSEN = "SettingChosen"  # an `auto` setting resolved, e.g. the backend
    INCOMPATIBLE_CHECKPOINT = "IncompatibleCheckpoint"


class TrainerEvent(Wire):
    """One thing that happened in the trainer, numbered so the operator reports it once."""

    seq: int = Field(..., ge=1, le=2**31 - 1, description="Increasing within one trainer run.")
    type: TrainerEventType = Field(..., description="What happened.")
    message: str = Field("", max_length=1024, description="Detail for people.")
    step: Step | None = Field(None, description="Training step it happened at.")
    checkpoint: CheckpointRef | None = Field(None, description="The checkpoint concerned, if any.")
    time: IsoTime = Field(..., description="When it happened.")


class StepProgress(Wire):
    """Where training stands at its last step, as rank 0 sees it: the job's `status.progress` is these fields as
    reported."""

    step: Step = Field(..., description="Last completed optimizer step.")
    total_steps: Annotated[int, Field(ge=1, le=100_000_000)] | None = Field(None, description="Steps to train.")
    loss: Finite | None = Field(None, description="Mean loss over ranks at `step`.")
    eval_loss: Finite | None = Field(None, description="Loss on the held-out records at the last evaluation.")
    tokens_per_second: Annotated[float, Field(allow_inf_nan=False, ge=0, le=1e13)] | None = Field(
        None, description="Throughput over all processes."
    )
    mfu: Annotated[float, Field(allow_inf_nan=False, ge=0, le=1)] | None = Field(
        None,
        description="Model FLOPs utilisation, 0 to 1, from the FLOPs done: a frozen weight (LoRA, QLoRA) "
        "costs its forward and input-gradient matmuls, not a weight gradient.",
    )
    mfu_6n: Annotated[float, Field(allow_inf_nan=False, ge=0, le=1)] | None = Field(
        None,
        alias="mfu6n",
        description="Model FLOPs utilisation, 0 to 1, by the 6·N convention other trainers report (every "
        "weight's gradient counted); the same as mfu for full training.",
    )
    reward_accuracy: Annotated[float, Field(allow_inf_nan=False, ge=0, le=1)] | None = Field(
        None,
        description="Preference training (DPO): the share of pairs, over the last logEvery steps, whose chosen "
        "answer's reward beats the rejected one's.",
    )
    reward_margin: Finite | None = Field(
        None, description="DPO: the mean of the chosen reward less the rejected one over the last logEvery steps."
    )
    chosen_reward: Finite | None = Field(
        None, description="DPO: the mean reward (beta times the log-ratio to the reference) of the chosen answers."
    )
    rejected_reward: Finite | None = Field(None, description="DPO: the mean reward of the rejected answers.")
    restart: Annotated[int, Field(ge=0, le=1000)] | None = Field(
        None, description="Times torchrun has restarted the workers in place before this run (0: the first run)."
    )
    nodes: Annotated[int, Field(ge=1, le=1024)] | None = Field(
        None, description="Nodes in the rendezvous round this run trains with (an elastic job's current size)."
    )
    global_batch_size: Annotated[int, Field(ge=1, le=100_000_000)] | None = Field(
        None, description="Samples per optimizer step at this world size (micro batch x accumulation x processes)."
    )
    updated_at: IsoTime = Field(..., description="When the trainer wrote this (its own clock).")


class TrainingProgress(StepProgress):
    """Where training stands, with the newest committed checkpoint: what rank 0 keeps and reports."""

    last_checkpoint: CheckpointRef | None = Field(None, description="Newest committed checkpoint.")


class ProgressReport(TrainingProgress):
    """What rank 0 posts to the operator: who it is, where training stands, and what happened lately."""

    version: int = Field(CONTRACT_VERSION, description="Contract version the report is written in.")
    uid: str = Field(..., min_length=1, max_length=64, pattern=r"^[0-9a-zA-Z-]+$", description="The job's UID.")
    namespace: str = Field(..., min_length=1, max_length=63, description="The job's namespace.")
    name: str = Field(..., min_length=1, max_length=253, description="The job's name.")
    attempt: int = Field(..., ge=0, le=1_000_000, description="The attempt the reporting pod belongs to.")
    run: str = Field(..., min_length=1, max_length=32, description="Random id of this trainer process.")
    events: list[TrainerEvent] = Field(
        default_factory=list, max_length=MAX_EVENTS, description="The newest trainer events, oldest first."
    )

    @field_validator("version")
    @classmethod
    def _readable(cls, v: int) -> int:
        if v not in SUPPORTED_VERSIONS:
            raise ValueError(
                f"report version {v} is not readable by this release (it reads {sorted(SUPPORTED_VERSIONS)}); "
                "run an operator at least as new as the trainer image"
            )
        return v
