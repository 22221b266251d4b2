"""Activation checkpointing's two policies on a real (tiny) Llama block: what backward recomputes, and that the
gradients do not change."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sharded_api.config import TrainerConfig
from tinyhf import write_model


class _MatmulCounter(TorchDispatchMode):
    """Counts the matrix products, and attention's forward kernels, dispatched while it is on."""

    def __init__(self):
        super().__init__()
        self.count = self.attention = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.count += 1
        name = func.name()
        if "scaled_dot_product" in name and "backward" not in name:
            self.attention += 1
        return func(*args, **(kwargs or {}))


class Run(NamedTuple):
    forward: int  # matrix products dispatched in forward
    backward: int  # ... and in backward
    grads: dict[str, torch.Tensor]
    attention_again: int  # attention forward kernels dispatched in backward (recomputed)


def _run(directory, checkpointing: str | None, lora: dict | None = None) -> Run:
    """Matrix products in forward and in backward, and the gradients, of one step with `checkpointing`."""
    from sharded_trainer.modeling.build import build_network
    from sharded_trainer.strategies.parallel import decoder_layers, materialize, wrap_blocks

    torch.manual_seed(0)
    cfg = {"model": {"huggingface": {"path": str(directory)}}, **({"lora": lora} if lora else {})}
    net = build_network(TrainerConfig.model_validate(cfg))
    materialize(net.module, torch.device("cpu"), net.source)
    wrap_blocks(decoder_layers(net.module), checkpointing=checkpointing, compile=False)
    vocab = net.module.get_input_embeddings().num_embeddings
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    with _MatmulCounter() as forward:
        logits = net.module(input_ids=tokens).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    with _MatmulCounter() as backward:
        loss.backward()
    grads = {name: p.grad.clone() for name, p in net.module.named_parameters() if p.grad is not None}
    # The wrapper's prefix is not part of the parameter's name (state dicts strip it too).
    grads = {name.replace("_checkpoint_wrapped_module.", ""): g for name, g in grads.items()}
    return Run(forward.count, backward.count, grads, backward.attention)


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("llama") / "llama", "llama")


@pytest.fixture(scope="module")
def runs(directory):
    return {policy: _run(directory, policy) for policy in (None, "full", "selective")}


def test_under_lora_selective_checkpointing_redoes_only_the_adapters_narrow_products(directory):
    """An adapter's B widens rank r to the layer's width: redoing it costs next to nothing, keeping its output as
    much memory as the base layer's, so it alone is recomputed (rank 4 on a block 64 wide)."""
    lora = {"r": 4, "alpha": 8}
    forward, plain_backward, plain, _ = _run(directory, None, lora)
    layers, linears = 2, 7
    assert forward == layers * linears * 3 + 1  # base, A and B of each linear; the head
    _, backward, grads, _ = _run(directory, "selective", lora)
    # Recomputation stops once backward has what it needs: the down projection's B output feeds only the next
    # block, so it is not redone.
    assert backward == plain_backward + layers * (linears - 1)
    assert grads.keys() == plain.keys() and plain and all("lora_" in name for name in grads)
    for name, g in plain.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=0, msg=name)


def test_full_checkpointing_runs_every_block_product_again_and_selective_none(runs):
    forward, plain_backward, _, _ = runs[None]
    layers = 2  # tinyhf's Llama: each block has 7 products (q, k, v, o, gate, up, down), the head 1
    assert forward == 7 * layers + 1
    full_backward, selective_backward = runs["full"].backward, runs["selective"].backward
    # Full recomputation stops once it has what backward needs: every product but the block's last (down's
    # output feeds only the next block, whose input the checkpoint keeps).
    assert full_backward == plain_backward + 6 * layers, "full checkpointing recomputes a block's products"
    assert selective_backward == plain_backward, "selective checkpointing must keep every product's output"


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_checkpointing_leaves_the_gradients_as_they_were(runs, policy):
    plain, grads = runs[None].grads, runs[policy].grads
    assert grads.keys() == plain.keys()
    for name, g in plain.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=0, msg=name)


def test_the_policy_is_spelled_in_the_strategy_options():
    from sharded_api.config import TrainerConfig as Config

    cfg = Config.model_validate(
        {"strategy": {"fsdp": {"activationCheckpointing": True, "activationCheckpointingPolicy": "selective"}}}
    )
    assert cfg.strategy.fsdp.checkpointing == "selective"
    assert (
        Config.model_validate({"strategy": {"zero2": {"activationCheckpointing": True}}}).strategy.zero2.checkpointing
        == "full"
    )
    assert (
        Config.model_validate(
            {"strategy": {"fsdp": {"activationCheckpointingPolicy": "selective"}}}
        ).strategy.fsdp.checkpointing
        is None
    )
    with pytest.raises(ValueError, match="activationCheckpointingPolicy"):
        Config.model_validate({"strategy": {"fsdp": {"activationCheckpointingPolicy": "some"}}})


def test_selective_checkpointing_keeps_attentions_output_on_the_cpu_kernel_too(runs):
    """On CPU (gloo runs) attention is `_scaled_dot_product_flash_attention_for_cpu`: selective checkpointing
    keeps its output as it does the GPU kernels', so backward never runs attention's forward again; full
    checkpointing does, once per block."""
    recomputed = {policy: run.attention_again for policy, run in runs.items()}
    assert recomputed == {None: 0, "full": 2, "selective": 0}, recomputed
