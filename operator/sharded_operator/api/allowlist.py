"""The pieces the pod allowlist's rows are made of (`overrides`): its parameters as the cluster admin sets
them, and each check twice, as a Python predicate over the spec's camelCase dump and as CEL over
`object.spec` for the admission policy."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Volume types a plain pod may use without reaching anything of the namespace's but its own claims and
# ConfigMaps: no Secret, no ServiceAccount token, nothing of the host's, no network or CSI driver.
VOLUME_KEYS = ("name", "emptyDir", "configMap", "downwardAPI", "persistentVolumeClaim", "projected")
# A projected volume may combine only these (serviceAccountToken would undo automountServiceAccountToken).
PROJECTED_SOURCES = ("configMap", "downwardAPI")
# Node labels and taints that mark the control plane: a training pod has no business there.
CONTROL_PLANE_KEYS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_RDMA_RESOURCE = "rdma/ib"


@dataclass(frozen=True)
class Allow:
    """The allowlist's parameters, as the cluster admin sets them (chart values `podPolicy.*`)."""

    annotation_prefixes: tuple[str, ...] = ()
    gpu_resources: tuple[str, ...] = (DEFAULT_GPU_RESOURCE,)
    rdma_resources: tuple[str, ...] = (DEFAULT_RDMA_RESOURCE,)

    def variables(self) -> dict[str, str]:
        """The policy's CEL variables for these parameters (JSON lists are CEL list literals)."""
        return {
            "annotationPrefixes": json.dumps(list(self.annotation_prefixes)),
            "gpuResources": json.dumps(list(self.gpu_resources)),
            "rdmaResources": json.dumps(list(self.rdma_resources)),
        }


# --- the Python side: predicates over the spec's camelCase dump ------------------------------------


def dig(d: Any, *path: str, default: Any = None) -> Any:
    for key in path:
        if not isinstance(d, dict) or d.get(key) is None:
            return default
        d = d[key]
    return d


def containers(s: dict) -> list[dict]:
    return [*(dig(s, "pod", "initContainers") or []), *(dig(s, "pod", "sidecars") or [])]


def env_reads_secret(env: list) -> bool:
    return any(isinstance(e, dict) and "secretKeyRef" in (e.get("valueFrom") or {}) for e in env)


def volume_ok(v: dict) -> bool:
    sources = dig(v, "projected", "sources") or []
    return all(k in VOLUME_KEYS for k in v) and all(all(k in PROJECTED_SOURCES for k in src) for src in sources)


def affinity_keys(s: dict) -> list[str]:
    node = dig(s, "scheduling", "affinity", "nodeAffinity") or {}
    terms = dig(node, "requiredDuringSchedulingIgnoredDuringExecution", "nodeSelectorTerms") or []
    prefs = [p.get("preference") or {} for p in node.get("preferredDuringSchedulingIgnoredDuringExecution") or []]
    return [e.get("key") for t in [*terms, *prefs] for e in t.get("matchExpressions") or []]


def infiniband_ok(s: dict, allow: Allow) -> bool:
    if not dig(s, "network", "infiniband", "enabled", default=False):
        return True
    return (
        dig(s, "resources", "gpusPerNode", default=0) > 0
        and dig(s, "resources", "gpuResourceName", default=DEFAULT_GPU_RESOURCE) in allow.gpu_resources
        and dig(s, "network", "infiniband", "resourceName", default=DEFAULT_RDMA_RESOURCE) in allow.rdma_resources
    )


# --- the CEL side: the same checks over `object.spec` -------------------------------------------

POD_CEL = "object.spec.pod"


def cel_if_set(path: str, then: str) -> str:
    """`then` where every optional step of `path` (below object.spec) is set; true otherwise."""
    parts = path.split(".")
    guards = [f"has({'.'.join(parts[: i + 1])})" for i in range(2, len(parts))]
    return f"!({' && '.join(guards)}) || {then}" if guards else then


def cel_list(values: tuple[str, ...]) -> str:
    return json.dumps(list(values))


def cel_or(path: str, default: Any) -> str:
    parts = path.split(".")
    guards = " && ".join(f"has({'.'.join(parts[: i + 1])})" for i in range(2, len(parts)))
    return f"({guards} ? {path} : {json.dumps(default)})"


def each_container(body: str) -> str:
    return " && ".join(f"({cel_if_set(f'{POD_CEL}.{kind}', f'{POD_CEL}.{kind}.all(c, {body})')})"
                       for kind in ("initContainers", "sidecars"))  # fmt: skip


NO_SECRET_ENV = "(!has(c.env) || c.env.all(e, !has(e.valueFrom) || !has(e.valueFrom.secretKeyRef)))"
NO_SECRET_ENV_FROM = "(!has(c.envFrom) || c.envFrom.all(f, !has(f.secretRef)))"
CP_KEYS_CEL = cel_list(CONTROL_PLANE_KEYS)  # the control-plane label keys as a CEL list
_NA = "object.spec.scheduling.affinity.nodeAffinity"
_REQ = f"{_NA}.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"
_PREF = f"{_NA}.preferredDuringSchedulingIgnoredDuringExecution"
_NOT_CP = f"!(e.key in {CP_KEYS_CEL})"
CONTROL_PLANE_CEL = " && ".join(f"({cel_if_set(path, then)})" for path, then in (
    ("object.spec.scheduling.nodeSelector", f"object.spec.scheduling.nodeSelector.all(k, !(k in {CP_KEYS_CEL}))"),
    (_REQ, f"{_REQ}.all(t, !has(t.matchExpressions) || t.matchExpressions.all(e, {_NOT_CP}))"),
    (_PREF, f"{_PREF}.all(w, !has(w.preference) || !has(w.preference.matchExpressions) || "
            f"w.preference.matchExpressions.all(e, {_NOT_CP}))"),
))  # fmt: skip
