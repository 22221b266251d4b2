"""Operator settings in one place, read once from `SHARDED_OPERATOR_*` environment variables."""

from __future__ import annotations

import fnmatch
import os
import socket
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sharded_api.contract import DEFAULT_CONFIG_PATH
from sharded_operator.api.allowlist import DEFAULT_GPU_RESOURCE, DEFAULT_RDMA_RESOURCE, Allow
from sharded_operator.api.overrides import NAMES

ENV_PREFIX = "SHARDED_OPERATOR_"


# The ports host-network jobs bind (one each), below the kernel's ephemeral range.
DEFAULT_HOST_PORTS = (29500, 30499)


class OperatorSettings(BaseModel):
    """Everything an operator deployment may tune; the Helm chart sets these as env variables."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespaces: list[str] = Field(
        default_factory=list, description="Namespaces to watch (comma-separated); empty watches the whole cluster."
    )
    ignore_namespaces: list[str] = Field(
        default_factory=lambda: ["kube-system"],
        description="Namespaces (comma-separated, globs allowed) whose jobs the operator leaves alone, even when it "
        "watches the whole cluster: by default kube-system, where no training pod belongs.",
    )
    http_host: str = Field("0.0.0.0", description="Address of the HTTP servers (/metrics, /healthz; /progress).")
    http_port: int = Field(8080, ge=1, le=65535, description="Port of /metrics and /healthz.")
    progress_port: int = Field(8081, ge=1, le=65535, description="Port of POST /progress (training pods only).")
    progress_url: str | None = Field(
        None,
        description="URL pods post progress to (e.g. http://sharded-operator.ops.svc:8081/progress); "
        "unset disables live progress.",
    )
    progress_audience: str = Field(
        "training.sharded.dev/progress", min_length=1, max_length=253,
        description="Audience of the projected ServiceAccount token a pod proves itself with.",
    )  # fmt: skip
    progress_write_seconds: float = Field(
        10.0, ge=0, le=3600, description="At most one progress write into a job's status per this many seconds."
    )
    reports_per_second: float = Field(2.0, gt=0, description="Progress reports taken per pod per second (burst x5).")
    token_reviews_per_second: float = Field(
        50.0, gt=0, description="TokenReviews of unknown tokens per second, for all pods (burst x2)."
    )
    token_seconds: int = Field(3600, ge=600, le=86400, description="Lifetime of the pods' progress tokens.")
    stuck_seconds: float = Field(
        120.0, gt=0, description="/healthz fails when one of the operator's loops has not run for this long."
    )
    lease_name: str | None = Field(
        None, max_length=253,
        description="Lease through which replicas elect the one that acts (HA); unset: this replica always acts.",
    )  # fmt: skip
    lease_namespace: str = Field("default", max_length=63, description="Namespace of the Lease (the operator's).")
    identity: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}", max_length=253,
        description="This replica's name in the Lease.",
    )  # fmt: skip
    resync_seconds: float = Field(
        300.0, gt=0,
        description="How often every unfinished job is reconciled without events: a safety net, as every event and "
        "every deadline or timeout a decision depends on schedules its own look.",
    )  # fmt: skip
    reconcile_workers: int = Field(
        8, ge=1, le=64, description="Jobs reconciled at once (each by one worker; API calls run in parallel)."
    )
    restart_grace_seconds: int = Field(30, ge=0, description="Grace period when a gang is torn down for a restart.")
    suspend_grace_seconds: int = Field(
        120, ge=0, description="Grace period on suspend: time for the trainer's final checkpoint."
    )
    trainer_config_path: str = Field(DEFAULT_CONFIG_PATH, description="Where pods read the trainer config.")
    cpu_procs_per_node: int = Field(2, ge=1, description="procsPerNode 'auto' on a CPU-only job.")
    forbid_pod_overrides: list[str] = Field(
        default_factory=list,
        description="Rows of the pod allowlist (sharded_operator.api.overrides) that are refused for every job "
        "(comma-separated), e.g. volumes,hostNetwork,annotations. For clusters without admission policies; the "
        "chart's policy checks the submitter instead.",
    )
    annotation_prefixes: list[str] = Field(
        default_factory=list,
        description="Pod annotation prefixes a job-only user may set (comma-separated); others are a risky override.",
    )
    gpu_resource_names: list[str] = Field(
        default_factory=lambda: [DEFAULT_GPU_RESOURCE],
        description="GPU resource names of this cluster (comma-separated): the InfiniBand profile, with its host "
        "network and IPC_LOCK, is in the allowlist only with one of them.",
    )
    rdma_resource_names: list[str] = Field(
        default_factory=lambda: [DEFAULT_RDMA_RESOURCE],
        description="RDMA device resource names of this cluster (comma-separated), as gpu_resource_names.",
    )
    host_port_range: str = Field(
        "-".join(map(str, DEFAULT_HOST_PORTS)), pattern=r"^\d+-\d+$",
        description="Ports (lo-hi) host-network jobs bind on their nodes, one per job; keep it below the kernel's "
        "ephemeral range (32768-60999 by default) so no connection's local port takes it.",
    )  # fmt: skip
    pod_uid: int = Field(1000, ge=1, le=2**31 - 1, description="UID and GID training pods run as (the image's user).")
    metrics_max_jobs: int = Field(
        1000, ge=0, le=100_000,
        description="Jobs whose training metrics (step, loss, tokens/s, checkpoint age...) are exported per job; past "
        "it a finished job's series give way, and live jobs beyond it are counted, not exported.",
    )  # fmt: skip
    log_format: str = Field("json", pattern="^(json|plain)$", description="json (structured) or plain logs.")

    @field_validator(
        "namespaces",
        "forbid_pod_overrides",
        "ignore_namespaces",
        "annotation_prefixes",
        "gpu_resource_names",
        "rdma_resource_names",
        mode="before",
    )
    @classmethod
    def _split(cls, value):
        return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value

    @field_validator("forbid_pod_overrides")
    @classmethod
    def _known(cls, value):
        if unknown := set(value) - set(NAMES):
            raise ValueError(f"unknown pod overrides {sorted(unknown)}; choose from {sorted(NAMES)}")
        return value

    @field_validator("host_port_range")
    @classmethod
    def _ports(cls, value: str) -> str:
        lo, hi = (int(x) for x in value.split("-"))
        if not 1024 <= lo <= hi < 32768:
            raise ValueError(f"{value}: want lo-hi within 1024-32767, below the ephemeral range")
        return value

    @property
    def allow(self) -> Allow:
        """The pod allowlist's parameters."""
        return Allow(tuple(self.annotation_prefixes), tuple(self.gpu_resource_names), tuple(self.rdma_resource_names))

    @property
    def host_ports(self) -> tuple[int, int]:
        lo, hi = self.host_port_range.split("-")
        return int(lo), int(hi)

    def ignores(self, namespace: str) -> bool:
        return any(fnmatch.fnmatchcase(namespace, pattern) for pattern in self.ignore_namespaces)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorSettings:
        """SHARDED_OPERATOR_<FIELD> for each field, e.g. SHARDED_OPERATOR_HTTP_PORT=9090."""
        env = os.environ if environ is None else environ
        values = {name: env[ENV_PREFIX + name.upper()] for name in cls.model_fields if ENV_PREFIX + name.upper() in env}
        return cls.model_validate(values)
