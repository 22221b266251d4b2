"""The pod overrides that give a job's pods more than a plain pod of the namespace gets, pure.

Whoever may create a ShardedTrainingJob gets pods created by the operator: without a check, a job would be a
way around what its submitter may do (a confused deputy). The chart's ValidatingAdmissionPolicy allows these
fields only to users who may create pods in the namespace themselves (CEL's `authorizer`); a controller
never learns who submitted a job, so without admission policies the operator can only refuse a field for
everyone (`forbidPodOverrides`).
"""

from __future__ import annotations

from collections.abc import Callable

from sharded_operator.models import ShardedTrainingJobSpec

# name -> (the field, whether a spec uses it)
RISKY: dict[str, tuple[str, Callable[[ShardedTrainingJobSpec], bool]]] = {
    "hostPath": ("spec.pod.volumes", lambda s: any("hostPath" in v for v in s.pod.volumes)),
    # The InfiniBand profile needs the host network on some fabrics: allowed with it.
    "hostNetwork": ("spec.network.hostNetwork", lambda s: s.network.host_network and not s.network.infiniband.enabled),
    "serviceAccountName": ("spec.pod.serviceAccountName", lambda s: s.pod.service_account_name is not None),
    "secretEnv": ("spec.pod.env", lambda s: any("secretKeyRef" in (e.value_from or {}) for e in s.pod.env)),
    "labels": ("spec.pod.labels", lambda s: bool(s.pod.labels)),
    # Without one, an added container gets the trainer's restricted securityContext; its own can ask for more.
    "containerSecurityContext": (
        "spec.pod.initContainers/sidecars",
        lambda s: any("securityContext" in (c.model_extra or {}) for c in [*s.pod.init_containers, *s.pod.sidecars]),
    ),
    # An added container's own env is a second way to a Secret: the same check as spec.pod.env.
    "containerSecretEnv": (
        "spec.pod.initContainers/sidecars[].env",
        lambda s: any(_reads_secrets(c.model_extra or {}) for c in [*s.pod.init_containers, *s.pod.sidecars]),
    ),
}


def _reads_secrets(container: dict) -> bool:
    """env valueFrom.secretKeyRef or envFrom secretRef in a core/v1 Container written as a dict."""
    env, env_from = container.get("env") or [], container.get("envFrom") or []
    return any(isinstance(e, dict) and "secretKeyRef" in (e.get("valueFrom") or {}) for e in env) or any(
        isinstance(f, dict) and "secretRef" in f for f in env_from
    )


def forbidden(spec: ShardedTrainingJobSpec, forbid: list[str]) -> str | None:
    """Why the job may not run under the operator's `forbidPodOverrides`, naming each field; None if it may."""
    used = [field for name, (field, uses) in RISKY.items() if name in forbid and uses(spec)]
    if not used:
        return None
    return (f"{', '.join(used)}: refused for every job by this operator's forbidPodOverrides setting; "
            "remove the field, or ask the cluster admin to allow it")  # fmt: skip
