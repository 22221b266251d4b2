"""Pure pieces of every pod the operator makes (training pods, export pods): security contexts, added
containers."""

from __future__ import annotations

from typing import Any

from sharded_operator.api.pods import ExtraContainer


def restricted(capabilities: dict[str, list[str]]) -> dict[str, Any]:
    """A container securityContext that Pod Security `restricted` admits (with `capabilities` as given)."""
    return {"allowPrivilegeEscalation": False, "capabilities": capabilities, "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"}}  # fmt: skip


def pod_security(uid: int) -> dict[str, Any]:
    """Non-root, and the claim writable through the group (fsGroup), as the trainer image's user."""
    return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
            "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"}}  # fmt: skip


def extra_container(c: ExtraContainer) -> dict[str, Any]:
    """An added container as the user wrote it, with the trainer's restricted securityContext unless it sets one."""
    out = c.model_dump(by_alias=True, exclude_none=True)
    out.setdefault("securityContext", restricted({"drop": ["ALL"]}))
    return out
