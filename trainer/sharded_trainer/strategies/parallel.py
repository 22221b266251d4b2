"""One training-step interface over FSDP2 and DeepSpeed ZeRO-2, each applied to an unchanged model."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from sharded_trainer.data.sources import Batch
from sharded_trainer.modeling.decoder import DTYPES, WeightSource
from sharded_trainer.modeling.quantize import fill_nf4, is_nf4
from sharded_trainer.process_group import DistEnv

__all__ = ["DTYPES", "Batch", "Strategy", "decoder_layers", "materialize", "to_device", "trainable", "wrap_blocks"]


class Strategy(Protocol):
    """What the training loop and the exporter need from a parallelism; model code sees none of it.

    A strategy owns its checkpoint format: what `save` writes into a step directory, how `load` reads
    it back into a running job, and how `full_model_state` reads the model alone in one process.
    """

    model: nn.Module
    # How the state is laid out over the processes, for people (the SettingChosen event).
    layout: str
    # The training objective (sft or dpo): each micro-batch's loss and the objective's own metrics.
    objective: object
    # What a forward pass goes through: the sharded model, or the engine that wraps it.
    forward_module: nn.Module

    def train_step(self, micro_batches: Sequence[Batch]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward/backward every micro-batch, step the optimizer. Returns this rank's mean loss and the
        global gradient norm (None when not computed) as device tensors: reading them synchronizes."""

    def current_lr(self) -> float: ...

    def eval_loss(self, batch: Batch) -> dict[str, float]:
        """Sums over a held-out micro-batch: `loss` (weighted), `weight` (tokens, or pairs, with a loss) and the
        objective's own; every rank must call it as often."""

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
        one process, without a process group (a LoRA run's checkpoint: the adapters only)."""


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Queue the copy of a host batch without making the host wait for the GPU. A copy from pageable
    memory synchronizes the stream: the targets' copy, made after forward is queued, would hold the host
    until forward finished, and the GPU would then idle while backward is being queued."""
    if device.type != "cuda":
        return batch
    return type(batch)(*(None if t is None else t.pin_memory().to(device, non_blocking=True) for t in batch))


@torch.no_grad()
def held_out_loss(objective, module: nn.Module, batch: Batch, device: torch.device) -> dict[str, float]:
    """The objective's sums over one held-out micro-batch, without gradients or dropout."""
    was_training = module.training
    module.eval()
    try:
        return objective.held_out(module, to_device(batch, device))
    finally:
        module.train(was_training)


def mean_over_ranks(value: torch.Tensor, env: DistEnv) -> float:
    """The mean over ranks of a local value (gloo has no AVG reduction, so SUM / world). Synchronizes:
    call it when logging, not every step."""
    import torch.distributed as dist

    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / env.world


def decoder_layers(model: nn.Module) -> nn.Module:
    """The container of the model's repeated blocks, found from the model rather than from a list of names:
    the largest ModuleList/ModuleDict whose children are all of one class, preferring a class the model
    declares unsplittable (transformers' `_no_split_modules`)."""
    unsplit: set[str] = set()
    for m in model.modules():
        unsplit |= set(getattr(m, "_no_split_modules", None) or ())
    lists = []
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m):
            # A block wrapped for activation checkpointing (ZeRO-2 wraps before QLoRA quantizes) is still that block.
            classes = {type(getattr(c, "_checkpoint_wrapped_module", c)).__name__ for c in m.children()}
            if len(classes) == 1:
                lists.append((bool(classes & unsplit), len(m), m))
    # Some models declare only parts of a block unsplittable (RoBERTa-PreLayerNorm: its attention): then the
    # largest list of blocks of one class is still the decoder's.
    best = max(lists, key=lambda entry: entry[:2])[2] if lists else None
    if best is None:
        raise ValueError(f"{type(model).__name__}: found no list of repeated decoder layers to shard block by block")
    return best


# What a selective checkpoint keeps: the outputs of the matrix products and of attention, the work that is
# costly to redo. Everything else in a block (norms, rotary, SiLU and its product, residual adds, casts) is
# recomputed from them in backward: element-wise passes over memory, a few percent of the block's time. A
# product's cost to redo over its output's size is its inner dimension: one whose inner dimension is at most an
# eighth of its output's width (a LoRA adapter's B, of rank r, widening to the layer's width) is recomputed, as
# keeping it would cost as much memory as the base layer's output for almost no work saved.
_NARROW = 8


def _selective_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    products = {aten.mm.default: 0, aten.bmm.default: 0, aten.addmm.default: 1}  # op -> its left operand
    attention = {
        getattr(aten, n).default
        for n in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
                  "_scaled_dot_product_flash_attention_for_cpu")  # the CPU fallback's kernel: the same rule
        if hasattr(aten, n)
    }  # fmt: skip

    def policy(ctx, op, *args, **kwargs):
        if op in products:
            left, right = args[products[op]], args[products[op] + 1]
            narrow = left.shape[-1] * _NARROW <= right.shape[-1]
            return CheckpointPolicy.PREFER_RECOMPUTE if narrow else CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_SAVE if op in attention else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def wrap_blocks(layers: nn.Module, *, checkpointing: str | None, compile: bool) -> list[nn.Module]:
    """Apply activation checkpointing (None, "full" or "selective": FsdpOptions.checkpointing) and torch.compile
    to each block of `layers` (decoder_layers); return them."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    extra = {"context_fn": _selective_context} if checkpointing == "selective" else {}
    for name, block in list(layers.named_children()):
        if checkpointing:
            # The wrapper keeps parameter names clean in state dicts (DCP strips its prefix).
            block = checkpoint_wrapper(block, preserve_rng_state=False, **extra)
            setattr(layers, name, block)
        if compile:
            block.compile()  # in place, so parameter FQNs do not gain an `_orig_mod.` prefix
    return list(layers.children())


def materialize(module: nn.Module, device: torch.device, source: WeightSource) -> None:
    """Allocate a meta-built (and maybe sharded) module on `device` and fill every parameter from `source`,
    asking it only for the rows this process keeps: a DTensor's local shard (FSDP2 shards dimension 0), or
    the whole tensor. Buffers (RoPE tables) were computed at build time and are kept."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    # A parameter registered twice (tied input and output embeddings) comes out of to_empty as two
    # parameters: remember where each one is registered and tie them again.
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for key, p in m._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((m, key))
    module.to_empty(device=device)
    for (first, key), *rest in (v for v in places.values() if len(v) > 1):
        for m, other in rest:
            setattr(m, other, getattr(first, key))
    with torch.no_grad():
        for name, b in module.named_buffers():
            b.copy_(buffers[name])
        for name, p in module.named_parameters():
            local, rows, group = p, None, None
            if isinstance(p, DTensor):
                local, group = p.to_local(), p.device_mesh.get_group()
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                if list(shape[1:]) != list(p.shape[1:]):
                    raise ValueError(f"{name}: sharded along a dimension other than the first ({p.placements})")
                rows = (offset[0], offset[0] + shape[0])
            data = source.read(name, p.shape, rows, local.dtype)
            if is_nf4(local):  # QLoRA's base: quantized here, from the rows this rank keeps
                fill_nf4(local, data, group)
            else:
                local.copy_(data)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer steps: all of them, or a LoRA run's adapters."""
    return [p for p in model.parameters() if p.requires_grad]
