"""Operator settings in one place, read once from `SHARDED_OPERATOR_*` environment variables."""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sharded_trainer.contract import DEFAULT_CONFIG_PATH

ENV_PREFIX = "SHARDED_OPERATOR_"


class OperatorSettings(BaseModel):
    """Everything an operator deployment may tune; the Helm chart sets these as env variables."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespaces: list[str] = Field(
        default_factory=list, description="Namespaces to watch (comma-separated); empty watches the whole cluster."
    )
    http_host: str = Field("0.0.0.0", description="Address of the HTTP server (/metrics, /healthz, /progress).")
    http_port: int = Field(8080, description="Port of the HTTP server.")
    progress_url: str | None = Field(
        None,
        description="URL pods post progress to (e.g. http://sharded-operator.ops.svc:8080/progress); "
        "unset disables live progress.",
    )
    peering: str | None = Field(None, description="kopf peering object name for HA (one active operator).")
    resync_seconds: float = Field(5.0, gt=0, description="How often each job is reconciled without events.")
    restart_grace_seconds: int = Field(30, ge=0, description="Grace period when a gang is torn down for a restart.")
    suspend_grace_seconds: int = Field(
        120, ge=0, description="Grace period on suspend: time for the trainer's final checkpoint."
    )
    trainer_config_path: str = Field(DEFAULT_CONFIG_PATH, description="Where pods read the trainer config.")
    cpu_procs_per_node: int = Field(2, ge=1, description="procsPerNode 'auto' on a CPU-only job.")
    log_format: str = Field("json", pattern="^(json|plain)$", description="json (structured) or plain logs.")

    @field_validator("namespaces", mode="before")
    @classmethod
    def _split(cls, value):
        return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorSettings:
        """SHARDED_OPERATOR_<FIELD> for each field, e.g. SHARDED_OPERATOR_HTTP_PORT=9090."""
        env = os.environ if environ is None else environ
        values = {name: env[ENV_PREFIX + name.upper()] for name in cls.model_fields if ENV_PREFIX + name.upper() in env}
        return cls.model_validate(values)
