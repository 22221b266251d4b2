"""The strategies' loss, which needs no process group."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sharded_trainer.modeling.loss import cross_entropy, loss_function

pytestmark = pytest.mark.trainer


@pytest.fixture
def logits_and_targets():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 48, 500, generator=g) * 4).bfloat16().requires_grad_()
    return logits, torch.randint(0, 500, (2, 48), generator=g)


def loss_and_grad(fn, logits, targets):
    logits.grad = None
    loss = fn(logits, targets)
    loss.backward()
    return loss.detach(), logits.grad.clone()


def test_cross_entropy_equals_upcasting_the_logits_first(logits_and_targets):
    def upcast_first(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))

    want_loss, want_grad = loss_and_grad(upcast_first, *logits_and_targets)
    loss, grad = loss_and_grad(cross_entropy, *logits_and_targets)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert torch.equal(loss, want_loss)
    assert torch.equal(grad, want_grad)


def test_compiled_loss_matches_the_eager_one(logits_and_targets):
    want_loss, want_grad = loss_and_grad(cross_entropy, *logits_and_targets)
    loss, grad = loss_and_grad(loss_function(compile=True), *logits_and_targets)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=2**-10)  # one bf16 ulp at the largest entries


def test_stochastic_rounding_keeps_updates_smaller_than_half_of_bf16s_spacing():
    """Adam's first updates are the learning rate itself: 1e-3 on weights of 1.0, where bf16's spacing is 2^-8
    below and 2^-7 above. Rounded to nearest (torch's AdamW on bf16 weights) each update is lost and the weights
    never move; bf16-pure's optimizer rounds stochastically, and its weights follow the fp32 ones on average."""
    from sharded_api.config import OptimizerConfig
    from sharded_trainer.strategies.optim import adamw_kwargs, stochastic_adamw

    torch.manual_seed(0)
    o = OptimizerConfig(lr=1e-3, weightDecay=0.0)
    rounded = torch.nn.Parameter(torch.ones(8192, dtype=torch.bfloat16))
    nearest = torch.nn.Parameter(torch.ones(8192, dtype=torch.bfloat16))
    exact = torch.nn.Parameter(torch.ones(8192))
    optimizers = {
        rounded: stochastic_adamw([rounded], o, torch.device("cpu")),
        nearest: torch.optim.AdamW([nearest], **adamw_kwargs(o)),
        exact: torch.optim.AdamW([exact], **adamw_kwargs(o)),
    }
    for _ in range(20):
        for weight, optimizer in optimizers.items():
            weight.grad = torch.ones_like(weight)
            optimizer.step()
    assert rounded.dtype == torch.bfloat16
    assert (nearest == 1).all()
    assert exact.mean().item() == pytest.approx(0.98, abs=1e-4)
    moved = 1 - rounded.float().mean().item()
    assert moved == pytest.approx(0.02, rel=0.05)
    assert len(rounded.float().unique()) > 1  # each weight rounded on its own, not all one way
