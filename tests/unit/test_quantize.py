"""QLoRA's NF4 block sizes: each process's rows of a weight must hold whole blocks of values and of scales."""

from __future__ import annotations

import pytest
import torch

from sharded_trainer.modeling.quantize import block_sizes, is_nf4, quantize_base


@pytest.mark.parametrize(
    ("shape", "shards", "sizes"),
    [
        ((4096, 4096), 8, (64, 256)),  # an 8B model's attention projection over 8 GPUs: QLoRA's own sizes
        ((14336, 4096), 16, (64, 256)),  # its MLP over 16
        ((1024, 4096), 1, (64, 256)),  # ZeRO-2 and one process: the whole weight
        ((32, 64), 4, (64, 8)),  # a tiny test model: fewer scales per block of scales
        ((6, 10), 2, (30, 1)),  # 30 values a shard: the largest block that divides them
    ],
)
def test_every_shard_holds_whole_blocks(shape, shards, sizes):
    assert block_sizes(torch.Size(shape), shards) == sizes
    block, scaler_block = sizes
    local = shape[0] // shards * shape[1]
    assert local % block == 0 and (local // block) % scaler_block == 0


@pytest.mark.parametrize(
    ("shape", "shards"),
    [((10, 64), 4), ((3, 1), 1), ((7, 3), 7)],  # rows that FSDP2 would pad; an odd count of values per shard
)
def test_a_weight_no_layout_fits_stays_unquantized(shape, shards):
    assert block_sizes(torch.Size(shape), shards) is None


def test_only_frozen_linear_weights_are_quantized_and_their_values_kept_within_nf4_error():
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(64, 31), torch.nn.LayerNorm(32))
    adapter = torch.nn.Linear(32, 32)
    layers.append(adapter)
    for p in layers.parameters():
        p.requires_grad_(p is adapter.weight or p is adapter.bias)
    dense = layers[0].weight.detach().clone()
    quantized = quantize_base(layers, shards=2)
    assert len(quantized) == 1 and quantized[0] is layers[0].weight and is_nf4(layers[0].weight)
    assert not is_nf4(layers[1].weight)  # 31 rows do not split over 2 processes
    assert not is_nf4(adapter.weight) and adapter.weight.requires_grad  # trained: left as it is
    error = (layers[0].weight.get_original_weight() - dense).norm() / dense.norm()
    assert 0 < error < 0.15
