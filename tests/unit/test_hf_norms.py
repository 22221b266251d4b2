"""The fused RMSNorm swap on Hugging Face models: which norms it takes, and that the model computes the
same function after it (forward and gradients), fp32 and bf16."""

from __future__ import annotations

import copy

import pytest
import torch

from sharded_trainer.modeling.hf import fuse_rms_norms
from tinyhf import ARCHITECTURES, model_config


def tiny(arch: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = model_config(arch, 96, pad_token_id=0, eos_token_id=1)
    config.num_hidden_layers = 2
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")


def loss_and_grads(model, tokens):
    model.zero_grad()
    logits = model(input_ids=tokens, use_cache=False).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return logits.detach(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


# Llama's norm code is shared verbatim by Qwen2/3 and Mistral: 2 per layer and the final one. Gemma's
# computes `x * (1 + weight)` in fp32: not Llama's function, it keeps its own. (Qwen3 also normalizes q
# and k per head with the same code: 2 more per layer.)
EXPECTED = {"llama": 5, "mistral": 5, "qwen2": 5, "qwen3": 9, "gemma": 0}


def with_norm_weights_away_from_one(model):
    # So that the weight's place in the rounding matters.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def max_error(got: dict, ref: dict) -> float:
    return max(((got[n] - ref[n]).abs().max() / ref[n].abs().max().clamp(min=1e-6)).item() for n in ref)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_only_norms_with_llamas_code_are_fused_and_the_model_computes_the_same(arch):
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    exact = with_norm_weights_away_from_one(tiny(arch, torch.float32))
    fused = copy.deepcopy(exact)
    assert fuse_rms_norms(fused) == EXPECTED[arch]
    # Parameters and their names are the model's own: checkpoints and exports do not see the swap.
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in exact.named_parameters()]
    ref_logits, ref_grads = loss_and_grads(exact, tokens)
    logits, grads = loss_and_grads(fused, tokens)
    # fp32: the same function to rounding.
    assert max_error({"logits": logits, **grads}, {"logits": ref_logits, **ref_grads}) < 1e-4

    # bf16: the swap moves one rounding, so it may differ from Llama's code by bf16 noise, but it must be no
    # further from the fp32 result than Llama's own code in bf16 is.
    reference = {"logits": ref_logits, **ref_grads}
    low = exact.to(torch.bfloat16)
    low_fused = copy.deepcopy(low)
    fuse_rms_norms(low_fused)
    own_logits, own_grads = loss_and_grads(low, tokens)
    fused_logits, fused_grads = loss_and_grads(low_fused, tokens)
    own = max_error({"logits": own_logits, **own_grads}, reference)
    swapped = max_error({"logits": fused_logits, **fused_grads}, reference)
    assert swapped <= 1.5 * own + 1e-3, (arch, swapped, own)


def test_a_norm_whose_weight_is_wider_than_its_input_keeps_llamas_result_type():
    model = tiny("llama", torch.float32)
    fuse_rms_norms(model)
    norm = model.model.norm
    out = norm(torch.randn(2, 3, norm.weight.shape[0], dtype=torch.bfloat16))
    assert out.dtype == torch.float32  # fp32 weight x bf16 activations, as Llama's code promotes
