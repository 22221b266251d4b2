"""The pod that consolidates a job's checkpoint on its claim (a preset's into one safetensors file, a Hugging
Face model's into a Hugging Face directory), built from one of the job's own training pods: the same image,
trainer config, claims, user and placement, no GPU, no network role. Pure; `client.Client.export` creates it
and waits for it."""

from __future__ import annotations

import copy
import posixpath
from typing import Any

from sharded_api.contract import step_dir_name
from sharded_operator.api.models import CONTAINER, GROUP, KIND, VERSION, ShardedTrainingJob
from sharded_operator.render.security import restricted

LABEL_EXPORT = f"{GROUP}/export-of"
EXPORT_DIR = "exports"
# What an export pod keeps of a training pod's spec: who it runs as and where it may be placed.
KEPT = ("securityContext", "imagePullSecrets", "runtimeClassName", "serviceAccountName", "nodeSelector",
        "tolerations", "affinity", "priorityClassName")  # fmt: skip


class ExportError(ValueError):
    """The job cannot be exported as it stands (no checkpoint storage, no pod to take the settings from)."""


def export_path(step: int, huggingface: bool = False) -> str:
    """Where the export lands, relative to the job's directory on its claim: a file, or a Hugging Face
    directory for a Hugging Face model."""
    return f"{EXPORT_DIR}/{step_dir_name(step)}" + ("" if huggingface else ".safetensors")


def export_pod(job: ShardedTrainingJob, training_pod: dict[str, Any], step: int, suffix: str) -> dict[str, Any]:
    """An export pod for `step`, from a training pod of the job (its volumes say where config and claim are)."""
    spec = training_pod["spec"]
    trainer = next(c for c in spec["containers"] if c["name"] == CONTAINER)
    mounts = {m["name"]: m for m in trainer.get("volumeMounts", [])}
    if "checkpoints" not in mounts:
        raise ExportError(f"{job.metadata['name']} has no checkpoint storage (spec.checkpoint): nothing to export")
    command = trainer["command"]
    config = command[command.index("--config") + 1]
    root = mounts["checkpoints"]["mountPath"]
    huggingface = job.spec.trainer.model.huggingface is not None
    # A Hugging Face export reads the base model (and tokenizer) again: the user's own volumes hold it.
    kept = {"trainer-config", "checkpoints", *(v["name"] for v in job.spec.pod.volumes if "name" in v)}
    volumes = [copy.deepcopy(v) for v in spec["volumes"] if v["name"] in kept]
    # Host memory for the whole model in fp32: the training pod's CPU and memory, none of its devices.
    requests = {k: v for k, v in (trainer.get("resources", {}).get("requests") or {}).items() if k in ("cpu", "memory")}
    container = {
        "name": "export",
        "image": trainer["image"],
        "command": ["python", "-m", "sharded_trainer", "export", "--config", config,
                    "--checkpoint", posixpath.join(root, step_dir_name(step)),
                    "--out", posixpath.join(root, export_path(step, huggingface))],
        "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": ""}],
        "volumeMounts": [copy.deepcopy(m) for n, m in mounts.items() if n in kept],
        "securityContext": restricted({"drop": ["ALL"]}),
        **({"resources": {"requests": requests, "limits": dict(requests)}} if requests else {}),
    }  # fmt: skip
    if "imagePullPolicy" in trainer:
        container["imagePullPolicy"] = trainer["imagePullPolicy"]
    meta = job.metadata
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{meta['name']}-export-{suffix}",
            "namespace": meta["namespace"],
            "labels": {LABEL_EXPORT: meta["name"]},
            # Deleted with the job; never one of its training pods (no job-name label).
            "ownerReferences": [
                {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": meta["name"], "uid": meta["uid"]}
            ],
        },
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "containers": [container],
            "volumes": volumes,
            **{k: copy.deepcopy(spec[k]) for k in KEPT if k in spec},
        },
    }


def location(pod: dict[str, Any], step: int) -> str:
    """`claim:path` of what an export pod writes."""
    claim = next(v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"] if v["name"] == "checkpoints")
    container = pod["spec"]["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "checkpoints")
    out = container["command"][container["command"].index("--out") + 1]
    return f"{claim}:{posixpath.join(mount.get('subPath', ''), posixpath.relpath(out, mount['mountPath']))}"
