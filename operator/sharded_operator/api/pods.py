"""What a job adds to its pods: environment, volumes, containers and sidecars, identity; each checked here and
against the pod-override allowlist (`overrides`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from sharded_api.cel import At, Each
from sharded_api.contract import RESERVED_ENV, RESERVED_ENV_PREFIX, PodEnv
from sharded_api.rules import Rule
from sharded_operator.api.spec import ApiModel


class EnvVar(ApiModel):
    """An environment variable for the trainer container."""

    name: str = Field(..., min_length=1, max_length=256, description="Variable name.")
    value: str | None = Field(None, description="Literal value.")
    value_from: dict[str, Any] | None = Field(None, description="A core/v1 EnvVarSource.")


DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
TRAINER_CONTAINER = "trainer"


class ExtraContainer(ApiModel):
    """A core/v1 Container added to the pods; the fields named here are checked, the rest passed on as written."""

    model_config = ConfigDict(extra="allow")
    rules = (
        Rule(
            "name", f"must not be {TRAINER_CONTAINER}: that is the training container's name",
            At("name").ne(TRAINER_CONTAINER),
            good=({"name": "fetch", "image": "busybox"},), bad=({"name": TRAINER_CONTAINER, "image": "busybox"},),
        ),
    )  # fmt: skip

    name: str = Field(..., max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", description="Container name.")
    image: str = Field(..., min_length=1, max_length=1024, description="Container image.")


class PodOverrides(ApiModel):
    """Additions to every pod of the job."""

    rules = (
        Rule(
            "env", f"must not set {RESERVED_ENV_PREFIX}* or {', '.join(RESERVED_ENV)}: the operator sets them for "
            "the rendezvous",
            Each(At("env"), "e", lambda e: ~e.field("name").starts_with(RESERVED_ENV_PREFIX)
                 & ~e.field("name").is_in(list(RESERVED_ENV))),
            good=({"env": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "MY_RANK", "value": "x"}]},),
            bad=(
                {"env": [{"name": PodEnv.NNODES.value, "value": "9"}]},
                {"env": [{"name": PodEnv.MASTER_ADDR.value, "value": "x"}]},
            ),
        ),
    )  # fmt: skip

    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=256,
        description=f"Extra environment. Rendezvous variables ({RESERVED_ENV_PREFIX}*, {', '.join(RESERVED_ENV[:3])}, "
        "...) are the operator's and are refused.",
    )
    volumes: list[dict[str, Any]] = Field(default_factory=list, description="Extra core/v1 Volumes.")
    volume_mounts: list[dict[str, Any]] = Field(default_factory=list, description="Extra VolumeMounts.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra pod annotations.")
    labels: dict[str, str] = Field(default_factory=dict, description="Extra pod labels.")
    service_account_name: str | None = Field(None, max_length=253, description="ServiceAccount of the pods.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        None, description="Image pull policy of the trainer container."
    )
    image_pull_secrets: list[Annotated[str, Field(max_length=253)]] = Field(
        default_factory=list, max_length=16, description="Secrets (names, in the job's namespace) for pulling images."
    )
    runtime_class_name: str | None = Field(
        None, max_length=253, pattern=DNS_SUBDOMAIN, description="RuntimeClass of the pods, e.g. nvidia."
    )
    init_containers: list[ExtraContainer] = Field(
        default_factory=list, max_length=8,
        description="core/v1 Containers run to completion before the trainer starts (e.g. fetching data). They get "
        "the trainer's restricted securityContext unless they set their own.",
    )  # fmt: skip
    sidecars: list[ExtraContainer] = Field(
        default_factory=list, max_length=8,
        description="core/v1 Containers running beside the trainer (e.g. a log shipper), as native sidecars: they "
        "start first and are stopped when the trainer ends, so the pod still completes. Restricted securityContext "
        "unless they set their own.",
    )  # fmt: skip


# An int-or-string field: the schema cannot type it, so CEL does what the pydantic type does.
