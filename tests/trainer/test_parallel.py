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
