"""What a compiled block keeps for its backward pass, with its MLP's base weights in bf16 (LoRA), in NF4
through torchao's linear (what compiled QLoRA did before), through RecomputedNF4Linear (what it does now),
and through a checkpoint around the whole linear layer (a variant left out): the bytes saved, the memory
held after the forward pass and the step's peak, on one GPU, at the 8B shape's MLP (4096 -> 14336, 8192
tokens). One line per variant.

    python bench/qlora_block_probe.py bf16|torchao|recomputed|checkpoint-linear
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from sharded_trainer.modeling.quantize import RecomputedNF4Linear, quantize_base

D, H, TOKENS = 4096, 14336, 8192


class MLPWithAdapter(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up = nn.Linear(D, H, bias=False), nn.Linear(D, H, bias=False)
        self.down = nn.Linear(H, D, bias=False)
        self.a, self.b = nn.Linear(D, 16, bias=False), nn.Linear(16, D, bias=False)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x)) + self.b(self.a(x))


def main(variant: str) -> None:
    if variant == "checkpoint-linear":
        RecomputedNF4Linear.forward = lambda self, x: checkpoint(
            nn.functional.linear, x, self.weight, self.bias, use_reentrant=False
        )
    torch.manual_seed(0)
    block = MLPWithAdapter().to("cuda", torch.bfloat16)
    for base in (block.gate, block.up, block.down):
        base.weight.requires_grad_(False)
    if variant != "bf16":
        quantize_base(block, shards=1, compiled=variant != "torchao")
    block.compile()
    x = torch.randn(2, TOKENS // 2, D, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    saved: list[torch.Tensor] = []
    for _ in range(3):  # the first compiles; the last is reported
        saved.clear()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
            y = block(x)
        held = torch.cuda.memory_allocated() - base
        y.float().sum().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    plain = [t for t in saved if type(t) is torch.Tensor]
    big = [tuple(t.shape) for t in plain if t.numel() > 1e6]
    mib = sum(t.numel() * t.element_size() for t in plain) / 2**20
    print(
        f"{variant}: saved {mib:.0f} MiB {big}; held after forward {held / 2**20:.0f} MiB; "
        f"step peak {peak / 2**20:.0f} MiB"
    )


if __name__ == "__main__":
    main(sys.argv[1])
