"""What a job-only user may put in a job's pods: an allowlist, written once, rendered as CEL and checked in Python.

Whoever may create a ShardedTrainingJob gets pods created by the operator: without a check, a job would be a
way around what its submitter may do (a confused deputy). Each row below is one way a job's pods could get
more than a plain, restricted pod of the namespace: a Secret or an API token mounted, the host's network or
ports, a node it should not run on. The chart's ValidatingAdmissionPolicy renders every row's CEL
(`make crds` writes `charts/.../files/pod-overrides.yaml`) and allows a row's field only to users who may
create pods in the namespace themselves (CEL's `authorizer`); a controller never learns who submitted a job,
so without admission policies the operator can only refuse a row for everyone (`forbidPodOverrides`).

A row is an allowlist: anything its check does not name is outside it, so a new volume type or a new
projected source is refused until a row admits it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import yaml
from pydantic import BaseModel

from sharded_operator.api.allowlist import (
    CONTROL_PLANE_CEL,
    CONTROL_PLANE_KEYS,
    CP_KEYS_CEL,
    DEFAULT_GPU_RESOURCE,
    DEFAULT_RDMA_RESOURCE,
    NO_SECRET_ENV,
    NO_SECRET_ENV_FROM,
    POD_CEL,
    PROJECTED_SOURCES,
    VOLUME_KEYS,
    Allow,
    affinity_keys,
    cel_if_set,
    cel_list,
    cel_or,
    containers,
    dig,
    each_container,
    env_reads_secret,
    infiniband_ok,
    volume_ok,
)


class PodOverride(StrEnum):
    """The rows of the allowlist by name: what `forbidPodOverrides` (the chart value, the operator setting)
    names, and the admission policy's and the operator's checks are keyed by."""

    VOLUMES = "volumes"
    ANNOTATIONS = "annotations"
    HOST_NETWORK = "hostNetwork"
    INFINIBAND = "infiniband"
    HOST_PORT = "hostPort"
    TOLERATIONS = "tolerations"
    CONTROL_PLANE = "controlPlane"
    SERVICE_ACCOUNT_NAME = "serviceAccountName"
    SECRET_ENV = "secretEnv"
    LABELS = "labels"
    CONTAINER_SECURITY_CONTEXT = "containerSecurityContext"
    CONTAINER_SECRET_ENV = "containerSecretEnv"


@dataclass(frozen=True)
class Override:
    """One row: the name forbidPodOverrides uses, the field an error names, what it would give, its two checks.

    `within` is true when the spec stays inside the allowlist; `cel` is the same over `object.spec` in the
    admission policy, with the variables of `Allow.variables`. `risky` are examples ({dotted path under `spec`:
    value}) that leave the allowlist, `safe` ones that stay in it: tests run each through the API server and
    through `within`.
    """

    name: PodOverride
    field: str
    gives: str
    cel: str
    within: Callable[[dict, Allow], bool]
    risky: tuple[dict[str, Any], ...]
    safe: tuple[dict[str, Any], ...] = field(default=())

    def message(self) -> str:
        return f"{self.field}: {self.gives} is allowed only to users who may create pods in this namespace"


ROWS: tuple[Override, ...] = (
    Override(
        PodOverride.VOLUMES,
        "spec.pod.volumes",
        "a volume other than emptyDir, configMap, downwardAPI, persistentVolumeClaim or a projected configMap/"
        "downwardAPI (a Secret, a ServiceAccount token, hostPath, a network or CSI volume)",
        cel_if_set(
            f"{POD_CEL}.volumes",
            f"{POD_CEL}.volumes.all(v, v.all(k, k in {cel_list(VOLUME_KEYS)}) && "
            f"(!has(v.projected) || !has(v.projected.sources) || "
            f"v.projected.sources.all(s, s.all(k, k in {cel_list(PROJECTED_SOURCES)}))))",
        ),
        lambda s, a: all(volume_ok(v) for v in dig(s, "pod", "volumes") or []),
        risky=(
            {"pod.volumes": [{"name": "host", "hostPath": {"path": "/etc"}}]},
            {"pod.volumes": [{"name": "creds", "secret": {"secretName": "db"}}]},
            {
                "pod.volumes": [
                    {
                        "name": "tok",
                        "projected": {
                            "sources": [
                                {"serviceAccountToken": {"path": "t", "audience": "https://kubernetes.default.svc"}}
                            ]
                        },
                    }
                ]
            },
            {"pod.volumes": [{"name": "nfs", "nfs": {"server": "10.0.0.1", "path": "/"}}]},
            {"pod.volumes": [{"name": "c", "csi": {"driver": "secrets-store.csi.k8s.io"}}]},
        ),
        safe=(
            {
                "pod.volumes": [
                    {"name": "data", "persistentVolumeClaim": {"claimName": "corpus"}},
                    {"name": "scratch", "emptyDir": {}},
                    {"name": "cfg", "configMap": {"name": "c"}},
                    {"name": "p", "projected": {"sources": [{"configMap": {"name": "c"}}]}},
                ]
            },
        ),
    ),
    Override(
        PodOverride.ANNOTATIONS,
        "spec.pod.annotations",
        "a pod annotation outside the prefixes the cluster admin allows (cloud IAM roles, AppArmor profiles)",
        cel_if_set(
            f"{POD_CEL}.annotations",
            f"{POD_CEL}.annotations.all(k, variables.annotationPrefixes.exists(p, k.startsWith(p)))",
        ),
        lambda s, a: all(
            any(k.startswith(p) for p in a.annotation_prefixes) for k in dig(s, "pod", "annotations") or {}
        ),
        risky=(
            {"pod.annotations": {"iam.amazonaws.com/role": "admin"}},
            {"pod.annotations": {"container.apparmor.security.beta.kubernetes.io/trainer": "unconfined"}},
        ),
    ),
    Override(
        PodOverride.HOST_NETWORK,
        "spec.network.hostNetwork",
        "the host network outside the InfiniBand profile",
        "!has(object.spec.network) || !has(object.spec.network.hostNetwork) || !object.spec.network.hostNetwork || "
        "(has(object.spec.network.infiniband) && has(object.spec.network.infiniband.enabled) && "
        "object.spec.network.infiniband.enabled)",
        lambda s, a: (
            not dig(s, "network", "hostNetwork", default=False)
            or dig(s, "network", "infiniband", "enabled", default=False)
        ),
        risky=({"network.hostNetwork": True},),
    ),
    Override(
        PodOverride.INFINIBAND,
        "spec.network.infiniband",
        "the InfiniBand profile (IPC_LOCK, the host network) without GPUs, or with GPU or RDMA resource names "
        "other than the cluster's",
        "!has(object.spec.network) || !has(object.spec.network.infiniband) || "
        "!has(object.spec.network.infiniband.enabled) || !object.spec.network.infiniband.enabled || ("
        f"{cel_or('object.spec.resources.gpusPerNode', 0)} > 0 && "
        f"{cel_or('object.spec.resources.gpuResourceName', DEFAULT_GPU_RESOURCE)} in variables.gpuResources && "
        f"{cel_or('object.spec.network.infiniband.resourceName', DEFAULT_RDMA_RESOURCE)} in variables.rdmaResources)",
        infiniband_ok,
        risky=(
            {
                "resources": {"gpusPerNode": 1, "gpuResourceName": "cpu"},
                "network": {"infiniband": {"enabled": True, "resourceName": "cpu"}, "hostNetwork": True},
            },
            {
                "resources": {"gpusPerNode": 8, "gpuResourceName": "example.com/gpu"},
                "network.infiniband": {"enabled": True},
            },
        ),
    ),
    Override(
        PodOverride.HOST_PORT,
        "spec.pod.initContainers/sidecars[].ports",
        "a hostPort (a port of the node's own address)",
        each_container("!has(c.ports) || c.ports.all(p, !has(p.hostPort))"),
        lambda s, a: (
            not any("hostPort" in p for c in containers(s) for p in c.get("ports") or [] if isinstance(p, dict))
        ),
        risky=({"pod.sidecars": [{"name": "s", "image": "i", "ports": [{"containerPort": 80, "hostPort": 80}]}]},),
        safe=({"pod.sidecars": [{"name": "s", "image": "i", "ports": [{"containerPort": 80}]}]},),
    ),
    Override(
        PodOverride.TOLERATIONS,
        "spec.scheduling.tolerations",
        "a toleration that names no taint key, or a control-plane taint",
        cel_if_set(
            "object.spec.scheduling.tolerations",
            f"object.spec.scheduling.tolerations.all(t, has(t.key) && t.key != '' && !(t.key in {CP_KEYS_CEL}))",
        ),
        lambda s, a: all(
            t.get("key") and t["key"] not in CONTROL_PLANE_KEYS for t in dig(s, "scheduling", "tolerations") or []
        ),
        risky=(
            {"scheduling.tolerations": [{"operator": "Exists"}]},
            {"scheduling.tolerations": [{"key": CONTROL_PLANE_KEYS[0], "operator": "Exists"}]},
        ),
        safe=({"scheduling.tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},),
    ),
    Override(
        PodOverride.CONTROL_PLANE,
        "spec.scheduling.nodeSelector/affinity",
        "placement on control-plane nodes",
        CONTROL_PLANE_CEL,
        lambda s, a: (
            not any(k in CONTROL_PLANE_KEYS for k in [*(dig(s, "scheduling", "nodeSelector") or {}), *affinity_keys(s)])
        ),
        risky=(
            {"scheduling.nodeSelector": {CONTROL_PLANE_KEYS[0]: ""}},
            {
                "scheduling.affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [{"key": CONTROL_PLANE_KEYS[1], "operator": "Exists"}]}
                            ]
                        }
                    }
                }
            },
        ),
        safe=({"scheduling.nodeSelector": {"nvidia.com/gpu.product": "H200"}},),
    ),
    Override(
        PodOverride.SERVICE_ACCOUNT_NAME,
        "spec.pod.serviceAccountName",
        "another ServiceAccount",
        f"!has({POD_CEL}) || !has({POD_CEL}.serviceAccountName)",
        lambda s, a: dig(s, "pod", "serviceAccountName") is None,
        risky=({"pod.serviceAccountName": "admin"},),
    ),
    Override(
        PodOverride.SECRET_ENV,
        "spec.pod.env",
        "an env value from a Secret",
        cel_if_set(f"{POD_CEL}.env", f"{POD_CEL}.env.all(e, !has(e.valueFrom) || !has(e.valueFrom.secretKeyRef))"),
        lambda s, a: not env_reads_secret(dig(s, "pod", "env") or []),
        risky=({"pod.env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]},),
    ),
    Override(
        PodOverride.LABELS,
        "spec.pod.labels",
        "an extra pod label (which can join other Services)",
        cel_if_set(f"{POD_CEL}.labels", f"size({POD_CEL}.labels) == 0"),
        lambda s, a: not dig(s, "pod", "labels"),
        risky=({"pod.labels": {"app": "payments"}},),
    ),
    # Without one, an added container gets the trainer's restricted securityContext; its own can ask for more.
    Override(
        PodOverride.CONTAINER_SECURITY_CONTEXT,
        "spec.pod.initContainers/sidecars",
        "a securityContext of an added container",
        each_container("!has(c.securityContext)"),
        lambda s, a: not any("securityContext" in c for c in containers(s)),
        risky=({"pod.sidecars": [{"name": "ship", "image": "busybox", "securityContext": {"privileged": True}}]},),
    ),
    # An added container's own env is a second way to a Secret: the same check as spec.pod.env.
    Override(
        PodOverride.CONTAINER_SECRET_ENV,
        "spec.pod.initContainers/sidecars[].env",
        "an env value from a Secret in an added container",
        each_container(f"{NO_SECRET_ENV} && {NO_SECRET_ENV_FROM}"),
        lambda s, a: (
            not any(
                env_reads_secret(c.get("env") or [])
                or any(isinstance(f, dict) and "secretRef" in f for f in c.get("envFrom") or [])
                for c in containers(s)
            )
        ),
        risky=(
            {"pod.initContainers": [{"name": "fetch", "image": "busybox", "envFrom": [{"secretRef": {"name": "db"}}]}]},
            {
                "pod.sidecars": [
                    {
                        "name": "s",
                        "image": "i",
                        "env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
                    }
                ]
            },
        ),
    ),
)
NAMES: tuple[str, ...] = tuple(row.name.value for row in ROWS)


def outside(spec: BaseModel | dict, allow: Allow) -> list[Override]:
    """The rows whose allowlist the spec leaves."""
    data = spec if isinstance(spec, dict) else spec.model_dump(by_alias=True, exclude_none=True, mode="json")
    return [row for row in ROWS if not row.within(data, allow)]


def forbidden(spec: BaseModel, forbid: list[str], allow: Allow | None = None) -> str | None:
    """Why the job may not run under the operator's `forbidPodOverrides`, naming each field; None if it may."""
    used = [row.field for row in outside(spec, allow or Allow()) if row.name in forbid]
    if not used:
        return None
    return (f"{', '.join(used)}: refused for every job by this operator's forbidPodOverrides setting; "
            "remove the field, or ask the cluster admin to allow it")  # fmt: skip


def validations() -> list[dict[str, str]]:
    """The admission policy's validations: each row, unless the submitter may create pods."""
    return [{"expression": f"variables.canCreatePods || ({row.cel})", "message": row.message(), "reason": "Forbidden"}
            for row in ROWS]  # fmt: skip


def render() -> str:
    """charts/.../files/pod-overrides.yaml, which the chart's admission policy includes."""
    header = "# Generated by `make crds` from operator/sharded_operator/api/overrides.py. Do not edit.\n"
    return header + yaml.safe_dump(validations(), sort_keys=False, width=100000)


def table() -> str:
    """The rows as docs/install.md's Markdown table (tests/unit/test_overrides.py holds the docs to it)."""
    lines = ["| `forbidPodOverrides` name | field | outside the allowlist: what a job-only user is refused |",
             "| --- | --- | --- |"]  # fmt: skip
    lines += [f"| `{row.name}` | `{row.field}` | {row.gives} |" for row in ROWS]
    return "\n".join(lines) + "\n"
