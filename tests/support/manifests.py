"""Test data: the examples and a table of malformed ShardedTrainingJobs, each naming the field at fault."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
DELETE = object()


def load_example(name: str = "quickstart-cpu") -> dict:
    return yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())


def mutate(obj: dict, changes: dict[str, Any]) -> dict:
    """Copy `obj` with dotted-path keys set (or removed with DELETE)."""
    out = copy.deepcopy(obj)
    for path, value in changes.items():
        node = out
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if value is DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return out


# (case id, changes to the quickstart example, field path the error must name)
MALFORMED: list[tuple[str, dict[str, Any], str]] = [
    ("zero-nodes", {"spec.nodes": 0}, "spec.nodes"),
    ("nodes-not-a-number", {"spec.nodes": "two"}, "spec.nodes"),
    ("too-many-nodes", {"spec.nodes": 5000}, "spec.nodes"),
    ("procs-per-node-word", {"spec.procsPerNode": "many"}, "spec.procsPerNode"),
    ("procs-per-node-zero", {"spec.procsPerNode": 0}, "spec.procsPerNode"),
    ("image-missing", {"spec.image": DELETE}, "spec.image"),
    ("image-empty", {"spec.image": ""}, "spec.image"),
    ("unknown-strategy", {"spec.strategy.type": "zero3"}, "spec.strategy.type"),
    ("fsdp-prefetch-too-deep", {"spec.strategy.fsdp": {"prefetch": 9}}, "spec.strategy.fsdp.prefetch"),
    (
        "zero2-bucket-too-small",
        {"spec.strategy.zero2": {"reduceBucketSize": 10}},
        "spec.strategy.zero2.reduceBucketSize",
    ),
    ("zero-steps", {"spec.trainer.steps": 0}, "spec.trainer.steps"),
    ("unknown-model-preset", {"spec.trainer.model": {"preset": "gpt-9"}}, "spec.trainer.model.preset"),
    ("unknown-precision", {"spec.trainer.precision": "int8"}, "spec.trainer.precision"),
    ("zero-learning-rate", {"spec.trainer.optimizer": {"lr": 0}}, "spec.trainer.optimizer.lr"),
    ("seq-len-too-short", {"spec.trainer.seqLen": 4}, "spec.trainer.seqLen"),
    ("tokens-without-path", {"spec.trainer.data": {"source": "tokens"}}, "spec.trainer.data"),
    (
        "hf-model-path-empty",
        {"spec.trainer.model": {"huggingface": {"path": ""}}},
        "spec.trainer.model.huggingface.path",
    ),
    (
        "hf-model-path-huge",
        {"spec.trainer.model": {"huggingface": {"path": "/m" * 3000}}},
        "spec.trainer.model.huggingface.path",
    ),
    (
        "lora-rank-zero",
        {"spec.trainer.model": {"huggingface": {"path": "/m"}}, "spec.trainer.lora": {"r": 0}},
        "spec.trainer.lora.r",
    ),
    (
        "lora-target-too-long",
        {"spec.trainer.model": {"huggingface": {"path": "/m"}}, "spec.trainer.lora": {"targetModules": ["q" * 300]}},
        "spec.trainer.lora.targetModules",
    ),
    (
        "lora-too-many-targets",
        {"spec.trainer.model": {"huggingface": {"path": "/m"}}, "spec.trainer.lora": {"targetModules": ["q"] * 65}},
        "spec.trainer.lora.targetModules",
    ),
    (
        "lora-unknown-quantization",
        {
            "spec.trainer.model": {"huggingface": {"path": "/m"}},
            "spec.resources": {"gpusPerNode": 8},
            "spec.trainer.lora": {"quantizeBase": "int3"},
        },
        "spec.trainer.lora.quantizeBase",
    ),
    ("eval-fraction-above-half", {"spec.trainer.data": {"evalFraction": 0.9}}, "spec.trainer.data.evalFraction"),
    ("interactive-port-privileged", {"spec.interactive": {"port": 80}}, "spec.interactive.port"),
    ("interactive-unknown-field", {"spec.interactive": {"jupyter": True}}, "spec.interactive.jupyter"),
    ("interactive-with-command", {"spec.interactive": {}, "spec.command": ["train.py"]}, "spec.interactive"),
    (
        "interactive-with-hang-timeout",
        {"spec.interactive": {}, "spec.failurePolicy.hangTimeoutSeconds": 600},
        "spec.interactive",
    ),
    ("unknown-top-level-field", {"spec.gpus": 8}, "spec.gpus"),
    ("unknown-nested-field", {"spec.strategy.fsdp": {"offload": True}}, "spec.strategy.fsdp.offload"),
    ("negative-gpus", {"spec.resources.gpusPerNode": -1}, "spec.resources.gpusPerNode"),
    ("memory-not-a-quantity", {"spec.resources.memory": "lots"}, "spec.resources.memory"),
    ("cpu-limit-below-request", {"spec.resources.cpu": 4, "spec.resources.cpuLimit": "3500m"}, "spec.resources"),
    ("memory-limit-below-request", {"spec.resources": {"memory": "2Gi", "memoryLimit": "1Gi"}}, "spec.resources"),
    ("sidecar-without-image", {"spec.pod.sidecars": [{"name": "ship"}]}, "spec.pod.sidecars[0].image"),
    (
        "init-container-named-trainer",
        {"spec.pod.initContainers": [{"name": "trainer", "image": "x"}]},
        "spec.pod.initContainers[0].name",
    ),
    ("runtime-class-not-a-name", {"spec.pod.runtimeClassName": "Not_A_Name"}, "spec.pod.runtimeClassName"),
    ("shm-not-a-quantity", {"spec.shmSize": "1 GB"}, "spec.shmSize"),
    ("unknown-backend", {"spec.network.backend": "mpi"}, "spec.network.backend"),
    ("infiniband-without-gpus", {"spec.network.infiniband": {"enabled": True}}, "spec.network.infiniband.enabled"),
    ("nccl-without-gpus", {"spec.network.backend": "nccl"}, "spec.network.backend"),
    ("privileged-rendezvous-port", {"spec.rendezvous.port": 80}, "spec.rendezvous.port"),
    ("elastic-min-above-max", {"spec.elastic": {"minNodes": 3, "maxNodes": 2}}, "spec.elastic"),
    ("nodes-outside-elastic-range", {"spec.nodes": 3, "spec.elastic": {"minNodes": 1, "maxNodes": 2}}, "spec.nodes"),
    (
        "two-checkpoint-claims",
        {"spec.checkpoint.existingClaim": "mine"},
        "spec.checkpoint",
    ),
    ("no-checkpoint-claim", {"spec.checkpoint.volumeClaim": DELETE}, "spec.checkpoint"),
    ("keep-no-checkpoints", {"spec.checkpoint.keepLast": 0}, "spec.checkpoint.keepLast"),
    ("relative-mount-path", {"spec.checkpoint.mountPath": "ckpt"}, "spec.checkpoint.mountPath"),
    ("claim-size-not-a-quantity", {"spec.checkpoint.volumeClaim.size": "big"}, "spec.checkpoint.volumeClaim.size"),
    (
        "unknown-access-mode",
        {"spec.checkpoint.volumeClaim.accessModes": ["ReadMany"]},
        "spec.checkpoint.volumeClaim.accessModes",
    ),
    (
        "async-save-with-zero2",
        {"spec.strategy.type": "zero2", "spec.checkpoint.async": True},
        "spec.checkpoint.async",
    ),
    ("negative-backoff", {"spec.failurePolicy.backoffLimit": -1}, "spec.failurePolicy.backoffLimit"),
    (
        "exit-code-out-of-range",
        {"spec.failurePolicy.permanentExitCodes": [300]},
        "spec.failurePolicy.permanentExitCodes",
    ),
    (
        "exit-code-both-retryable-and-permanent",
        {"spec.failurePolicy.retryableExitCodes": [1, 2]},
        "spec.failurePolicy",
    ),
    ("hang-timeout-too-short", {"spec.failurePolicy.hangTimeoutSeconds": 5}, "spec.failurePolicy.hangTimeoutSeconds"),
    (
        "startup-timeout-too-short",
        {"spec.failurePolicy.startupTimeoutSeconds": 5},
        "spec.failurePolicy.startupTimeoutSeconds",
    ),
    (
        "scheduling-timeout-zero",
        {"spec.failurePolicy.schedulingTimeoutSeconds": 0},
        "spec.failurePolicy.schedulingTimeoutSeconds",
    ),
    ("node-lost-too-soon", {"spec.failurePolicy.nodeLostSeconds": 1}, "spec.failurePolicy.nodeLostSeconds"),
    ("node-lost-never", {"spec.failurePolicy.nodeLostSeconds": 10**9}, "spec.failurePolicy.nodeLostSeconds"),
    ("count-disruptions-word", {"spec.failurePolicy.countDisruptions": "maybe"}, "spec.failurePolicy.countDisruptions"),
    (
        "negative-termination-grace",
        {"spec.runPolicy": {"terminationGraceSeconds": -1}},
        "spec.runPolicy.terminationGraceSeconds",
    ),
    ("unknown-clean-pod-policy", {"spec.runPolicy": {"cleanPodPolicy": "Some"}}, "spec.runPolicy.cleanPodPolicy"),
    ("env-overrides-torchrun", {"spec.pod": {"env": [{"name": "PET_NNODES", "value": "9"}]}}, "spec.pod.env"),
    ("env-overrides-master-addr", {"spec.pod": {"env": [{"name": "MASTER_ADDR", "value": "x"}]}}, "spec.pod.env"),
    (
        "more-procs-than-gpus",
        {"spec.resources.gpusPerNode": 4, "spec.procsPerNode": 8},
        "spec.procsPerNode",
    ),
    ("fsdp-with-fp16", {"spec.trainer.precision": "fp16"}, "spec.trainer.precision"),
    (
        "volcano-queue-for-coscheduling",
        {"spec.scheduling": {"gang": {"enabled": True, "provider": "scheduler-plugins", "queue": "research"}}},
        "spec.scheduling.gang.queue",
    ),
    (
        "volcano-queue-not-a-name",
        {"spec.scheduling": {"gang": {"enabled": True, "provider": "volcano", "queue": "Research Team!"}}},
        "spec.scheduling.gang.queue",
    ),
    (
        "volcano-queue-too-long",
        {"spec.scheduling": {"gang": {"enabled": True, "provider": "volcano", "queue": "q" * 64}}},
        "spec.scheduling.gang.queue",
    ),
    ("unknown-gang-provider", {"spec.scheduling": {"gang": {"provider": "kueue"}}}, "spec.scheduling.gang.provider"),
    ("name-too-long-for-hostnames", {"metadata.name": "a" * 51}, "metadata.name"),
]
