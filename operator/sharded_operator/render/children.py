"""The children of a job other than its pods: the trainer config (a ConfigMap named by its digest) and the
checkpoint claim. No API calls here; reconcile creates what these return and adds the owner reference itself
(`reconcile.adopt`), except on the checkpoint PVC, which outlives the job unless told otherwise."""

from __future__ import annotations

import hashlib
import posixpath
from typing import Any

import yaml

from sharded_api.config import CheckpointConfig, TrainerConfig
from sharded_operator.api.models import ANNOTATION_CREATED_BY, ShardedTrainingJob, ShardedTrainingJobSpec
from sharded_operator.render.names import job_labels, job_name, pvc_name
from sharded_operator.settings import OperatorSettings


def config_map_name(job: ShardedTrainingJob) -> str:
    """`<job>-config-<hash of the trainer config>`: a pod mounts the config its attempt was created with,
    so an edit of the spec takes effect at the next attempt and never under a running one."""
    return f"{job_name(job)}-config-{config_digest(job)}"


def config_digest(job: ShardedTrainingJob) -> str:
    rendered = trainer_config(job.spec).model_dump_json(by_alias=True, exclude_none=True)
    return hashlib.sha256(rendered.encode()).hexdigest()[:10]


def backend(s: ShardedTrainingJobSpec) -> str:
    if s.network.backend != "auto":
        return s.network.backend
    return "nccl" if s.resources.gpus_per_node > 0 else "gloo"


def trainer_config(s: ShardedTrainingJobSpec) -> TrainerConfig:
    """The full trainer config the pods read: the spec's training part plus strategy, storage and backend."""
    checkpoint = CheckpointConfig()
    if s.checkpoint:
        policy = s.checkpoint.model_dump(include={"interval", "keep_last", "async_save", "resume"})
        checkpoint = CheckpointConfig(dir=s.checkpoint.mount_path, **policy)
    # An elastic job keeps its full size's batch; the processes per node are known to the trainer only.
    batch_nodes = s.elastic.max_nodes if s.elastic and s.elastic.keep_global_batch else None
    return TrainerConfig(
        **s.trainer.model_dump(), strategy=s.strategy, checkpoint=checkpoint, backend=backend(s),
        batch_nodes=batch_nodes,
    )  # fmt: skip


# libyaml's emitter where PyYAML has it: the same text, a fifth of the pure-Python one's CPU per job.
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def build_config_map(job: ShardedTrainingJob, settings: OperatorSettings) -> dict[str, Any]:
    """The trainer config, under the file name the pods read it as (settings.trainer_config_path)."""
    cfg = trainer_config(job.spec).model_dump(by_alias=True, exclude_none=True, mode="json")
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": config_map_name(job), "labels": job_labels(job)},
        "data": {posixpath.basename(settings.trainer_config_path): yaml.dump(cfg, Dumper=_DUMPER, sort_keys=False)},
    }


def build_pvc(job: ShardedTrainingJob) -> dict[str, Any] | None:
    ck = job.spec.checkpoint
    if not ck or not ck.volume_claim:
        return None
    vc = ck.volume_claim
    spec: dict[str, Any] = {"accessModes": list(vc.access_modes), "resources": {"requests": {"storage": str(vc.size)}}}
    if vc.storage_class_name:
        spec["storageClassName"] = vc.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": pvc_name(job),
            "labels": job_labels(job),
            "annotations": {ANNOTATION_CREATED_BY: job.metadata.get("uid", "")},
        },
        "spec": spec,
    }
