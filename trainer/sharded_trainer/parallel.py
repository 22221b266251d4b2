"""One training-step interface over FSDP2 and DeepSpeed ZeRO-2, each applied to an unchanged model."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from sharded_trainer.process_group import DistEnv

Batch = tuple[torch.Tensor, torch.Tensor]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Strategy(Protocol):
    """What the training loop and the exporter need from a parallelism; model code sees none of it.

    A strategy owns its checkpoint format: what `save` writes into a step directory, how `load` reads
    it back into a running job, and how `full_model_state` reads the model alone in one process.
    """

    model: nn.Module
    # How the state is laid out over the processes, for people (the SettingChosen event).
    layout: str

    def train_step(self, micro_batches: Sequence[Batch]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward/backward every micro-batch, step the optimizer. Returns this rank's mean loss and the
        global gradient norm (None when not computed) as device tensors: reading them synchronizes."""

    def current_lr(self) -> float: ...

    def save(self, directory: Path, *, async_save: bool) -> object | None:
        """Write this rank's part of the model/optimizer/scheduler state; may return a pending future."""

    def load(self, directory: Path) -> None: ...

    @staticmethod
    def rank_files(rank: int) -> str:
        """Glob, relative to a step directory, of the files only `rank` writes in `save` (each rank flushes
        and checksums its own files at commit; rank 0 owns every file no rank's glob names)."""

    @staticmethod
    def weights_source(directory: Path) -> str:
        """Where `full_model_state` takes the weights of this checkpoint from, for the export's metadata."""

    @classmethod
    def full_model_state(cls, model: nn.Module, directory: Path) -> dict[str, torch.Tensor]:
        """The full (unsharded) model state from a checkpoint this strategy wrote, as float32 tensors, in
        one process, without a process group."""


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Queue the copy of a host batch without making the host wait for the GPU. A copy from pageable
    memory synchronizes the stream: the targets' copy, made after forward is queued, would hold the host
    until forward finished, and the GPU would then idle while backward is being queued."""
    if device.type != "cuda":
        return batch
    inputs, targets = (t.pin_memory().to(device, non_blocking=True) for t in batch)
    return inputs, targets


def mean_over_ranks(value: torch.Tensor, env: DistEnv) -> float:
    """The mean over ranks of a local value (gloo has no AVG reduction, so SUM / world). Synchronizes:
    call it when logging, not every step."""
    import torch.distributed as dist

    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / env.world


def wrap_blocks(model: nn.Module, *, activation_checkpointing: bool, compile: bool) -> list[nn.Module]:
    """Apply activation checkpointing and torch.compile to each transformer block; return the blocks."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name, block in list(model.layers.items()):
        if activation_checkpointing:
            # The wrapper keeps parameter names clean in state dicts (DCP strips its prefix).
            block = checkpoint_wrapper(block, preserve_rng_state=False)
            model.layers[name] = block
        if compile:
            block.compile()  # in place, so parameter FQNs do not gain an `_orig_mod.` prefix
    return list(model.layers.values())
