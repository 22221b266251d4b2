"""QLoRA's NF4 base under torch.compile: the compiled backward must dequantize the 4-bit weights again, not
keep their bf16 copies from the forward pass (which made compiled QLoRA hold more memory than bf16 LoRA),
and must not pay for it with extra matrix products. One compiled block, on the CPU, in this process."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import profile

from sharded_trainer.modeling.quantize import (
    FusedNF4Linear,
    RecomputedNF4Linear,
    _fused_dequantize,
    _NF4Matmul,
    quantize_base,
)

pytestmark = pytest.mark.trainer
D, TOKENS = 256, 64


class GatedBlock(nn.Module):
    """A SwiGLU-like block: SiLU's backward reads the gate projection's output, the product's backward the up
    projection's, as in a decoder's MLP; a trainable low-rank path beside them, as LoRA's."""

    def __init__(self):
        super().__init__()
        self.gate, self.up = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
        self.a, self.b = nn.Linear(D, 8, bias=False), nn.Linear(8, D, bias=False)

    def forward(self, x):
        return nn.functional.silu(self.gate(x)) * self.up(x) + self.b(self.a(x))


def _block(compiled: bool) -> GatedBlock:
    torch.manual_seed(0)
    block = GatedBlock().to(torch.bfloat16)
    for base in (block.gate, block.up):
        base.weight.requires_grad_(False)
    quantize_base(block, shards=1, compiled=compiled)
    return block


def _step(block: GatedBlock, x: torch.Tensor):
    """One forward and backward: the tensors saved for backward, the backward's matrix products, the grads."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype, type(t).__name__))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x)
    with profile() as prof:
        y.float().square().mean().backward()
    products = sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm"))
    return saved, products, (block.a.weight.grad.clone(), block.b.weight.grad.clone(), x.grad.clone())


def test_a_compiled_qlora_block_recomputes_the_dequantized_weights_and_no_product():
    x = torch.randn(TOKENS, D, dtype=torch.bfloat16)
    eager = _block(compiled=False)
    assert type(eager.gate) is FusedNF4Linear  # on this CPU: torchao's own linear (it saves the 4-bit weight)
    _, _, expected = _step(eager, x.clone().requires_grad_(True))

    block = _block(compiled=True)
    assert type(block.gate) is RecomputedNF4Linear and type(block.a) is nn.Linear  # the adapters are left alone
    assert set(block.state_dict()) == set(eager.state_dict())
    block.compile()
    for _ in range(2):  # the first call compiles; the second is the one measured
        for p in (block.a.weight, block.b.weight):
            p.grad = None
        saved, products, grads = _step(block, x.clone().requires_grad_(True))

    bf16_weights = [s for s in saved if s[0] == (D, D) and s[1] == torch.bfloat16 and s[2] == "Tensor"]
    assert not bf16_weights, f"the compiled forward kept dequantized base weights for backward: {saved}"
    # Backward's products: the input's gradient through gate, up, a and b, and the weight gradients of a and b.
    # Recomputing a projection's product instead of keeping it (a plain checkpoint's choice) would add two.
    assert products == 6, products
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2)


def test_the_eager_linear_dequantizes_in_one_compiled_kernel_and_keeps_only_the_4_bit_weight():
    """What FusedNF4Linear does on a GPU, run here on the CPU: the same products and gradients as torchao's
    linear, and nothing but the 4-bit weight kept for backward."""
    torch.manual_seed(1)
    block = _block(compiled=False)
    x = torch.randn(TOKENS, D, dtype=torch.bfloat16)
    want_x = x.clone().requires_grad_(True)
    want = nn.functional.linear(want_x, block.gate.weight)  # torchao's linear
    want.float().square().sum().backward()

    got_x = x.clone().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(type(t).__name__), t)[1], lambda t: t):
        got = _NF4Matmul.apply(got_x, block.gate.weight, None, _fused_dequantize())
    got.float().square().sum().backward()
    assert saved == ["NF4Tensor"], saved
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_x.grad, want_x.grad, rtol=2e-2, atol=2e-2)
