"""QLoRA's frozen base in NF4 (torchao's `NF4Tensor`, the 4-bit tensor that FSDP2 shards and all-gathers as
its packed bytes): every frozen linear weight of the decoder layers is quantized, the adapters, embeddings,
norms and output head stay in the compute dtype.

Under FSDP2 the weights are quantized where they are read: each rank quantizes only the rows it keeps, with
the double-quantization mean of the whole tensor (one all-reduce per weight), so the gathered weight is the
one that quantizing the full tensor gives and no rank ever holds a full-precision copy of a weight it does
not keep. ZeRO-2 keeps the whole base on every rank: it is loaded in bf16 and quantized in place.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

# NF4 packs two values per byte in blocks of 64 with one absmax each; the absmaxes are quantized again in
# blocks of 256 (QLoRA's double quantization). A shard must hold whole blocks of both.
BLOCK = 64
SCALER_BLOCK = 256


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def block_sizes(shape: torch.Size, shards: int) -> tuple[int, int] | None:
    """NF4 block sizes for a weight of `shape` split into `shards` equal row ranges, or None when its rows do
    not split evenly (FSDP2 would pad the last shard, which NF4 cannot hold): that weight stays unquantized.
    The standard sizes fit every weight of a released model; a small model gets smaller blocks."""
    rows, cols = shape
    local = rows // shards * cols
    if rows % shards or local % 2:  # NF4 packs two values per byte, shard by shard
        return None
    block = _largest_divisor(local, BLOCK)
    return block, _largest_divisor(local // block, SCALER_BLOCK)


class RecomputedNF4Linear(nn.Linear):
    """A linear layer over an NF4 weight whose dequantized copy is recomputed for the backward pass, not kept.

    torchao's NF4 linear saves the 4-bit weight for backward and dequantizes it again there, which holds in
    eager mode. A compiled block is partitioned by AOTAutograd, whose heuristics never recompute a value a
    backward matmul reads: it saved every dequantized bf16 weight from the forward pass to the backward, and
    compiled QLoRA held more memory than bf16 LoRA (8B shape: 58.8 GiB against 55.5). Here only the
    dequantization runs inside a checkpoint region, which the partitioner must recompute: the backward
    dequantizes again from the 4-bit weight, and the product stays outside, saved or not as for any
    linear layer (a region around the whole linear layer also recomputed the gate and up projections'
    products, which SiLU's backward reads: 0.83x LoRA's speed; a selective policy that saved the products
    kept those no backward needs: 6 GiB more). Only compiled blocks get this class
    (`quantize_base(..., compiled=True)`); eager ones get FusedNF4Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        weight = checkpoint(_dequantized, self.weight, x.dtype, use_reentrant=False)
        return nn.functional.linear(x, weight, self.bias)


def _dequantized(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return weight.to(dtype)


class FusedNF4Linear(nn.Linear):
    """Eager mode's linear layer over an NF4 weight on a GPU: torchao's dequantizes in about ten kernels,
    two of them writing every 4-bit code as an int64 index (16 bytes of traffic per weight for 2.5 that
    are needed), twice a step; eager QLoRA ran at 0.74-0.77x LoRA's speed. Here the same dequantization is
    one compiled kernel per weight shape (`_fused_dequantize`) and, as torchao's, the backward pass saves
    only the 4-bit weight and dequantizes it again. On a CPU, and with a trainable bias, torchao's linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda or (self.bias is not None and self.bias.requires_grad):
            return super().forward(x)
        return _NF4Matmul.apply(x, self.weight, self.bias, _fused_dequantize())


class _NF4Matmul(torch.autograd.Function):
    """x @ dequantize(weight).T (+ bias), keeping the 4-bit weight, not its dequantized copy, for backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, dequantize):
        ctx.save_for_backward(weight)
        ctx.dequantize = dequantize
        return nn.functional.linear(x, dequantize(weight, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad @ ctx.dequantize(weight, grad.dtype), None, None, None


@functools.cache
def _fused_dequantize():
    """torchao's dequantization compiled: one kernel per weight shape (a model has a handful)."""
    return torch.compile(_dequantized, fullgraph=True, dynamic=False)


def quantize_base(layers: nn.Module, shards: int, compiled: bool = False) -> list[nn.Parameter]:
    """Replace every frozen linear weight under `layers` with an NF4 tensor; returns the new parameters.
    FSDP2 calls it on the meta-device model before sharding (so it shards the 4-bit form, `shards` ways, and
    `fill_nf4` quantizes the values later); ZeRO-2 on the loaded model (the values are quantized here).
    Their layers become RecomputedNF4Linear where the blocks are (or will be) `compiled`, else FusedNF4Linear."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    quantized = []
    for module in layers.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, nn.Linear) or weight is None or weight.requires_grad:
            continue
        sizes = block_sizes(weight.shape, shards)
        if sizes is None:
            continue
        module.weight = nn.Parameter(to_nf4(weight.detach(), *sizes), requires_grad=False)
        if type(module) is nn.Linear:  # the same parameters, the same state-dict keys
            module.__class__ = RecomputedNF4Linear if compiled else FusedNF4Linear
        quantized.append(module.weight)
    return quantized


def is_nf4(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "NF4Tensor"


def fill_nf4(local: torch.Tensor, rows: torch.Tensor, group) -> None:
    """Quantize `rows` (this rank's part of a weight, in full precision) into the NF4 shard `local`, with the
    mean block absmax of the whole weight, summed over `group` (the processes that hold its other rows)."""
    import torch.distributed as dist
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, get_block_absmax

    block, scaler_block = local.block_size, local.scaler_block_size
    rows = rows.to(local.device, local.dtype).contiguous()
    absmax = get_block_absmax(rows.flatten(), block)
    total = absmax.float().sum()
    count = absmax.numel()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
        count *= dist.get_world_size(group)
    mean = (total / count).to(local.dtype)
    shifted = (absmax - mean).view(-1, scaler_block)
    factor = 256 / (2 * shifted.abs().amax(dim=1))  # int8 range per block of absmaxes
    scalers = (shifted * factor.unsqueeze(1)).round().clamp(-128, 127).flatten().to(torch.int8)
    lut = _lut(local)
    sharded = {
        "quantized_data": NF4Tensor.convert_to_norm_float_weight(rows, absmax.numel(), block, lut),
        "quantized_scalers": scalers, "quantization_factor": factor,
    }  # fmt: skip
    # The sharded parts go into the shard's own tensors, which FSDP2 all-gathers from. `to_empty` moved only
    # those: the mean and the code book, the same for every shard, are still the meta ones from the build.
    for name, value in sharded.items():
        getattr(local, name).copy_(value)
    local.scaler_mean, local.nf4 = mean, lut


def _lut(like: torch.Tensor) -> torch.Tensor:
    """NF4's 16 code points (QLoRA's normal-float quantiles), as torchao builds them."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    return NF4Tensor.from_tensor(torch.zeros(2, 2, dtype=like.dtype), 2, 1).nf4.to(like.device)


def nf4_bytes(model: nn.Module) -> int:
    """Bytes the NF4 weights hold on this rank (packed values, scalers, factors)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if is_nf4(local):
            parts = (local.quantized_data, local.quantized_scalers, local.quantization_factor)
            total += sum(math.prod(t.shape) * t.element_size() for t in parts)
    return total
