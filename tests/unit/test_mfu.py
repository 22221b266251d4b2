"""MFU, labelled two ways: from the FLOPs a step does (a frozen weight of LoRA or QLoRA computes no weight
gradient) and by the 6·N convention other trainers report; equal for full training."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from sharded_api.config import TrainerConfig
from sharded_trainer.modeling.hf import build_hf, linear_params
from sharded_trainer.reporting.metrics import Meter
from tinyhf import tiny_config

SEQ = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32).save_pretrained(str(path))
    return path


def network(path, **trainer):
    return build_hf(
        TrainerConfig.model_validate({"model": {"preset": None, "huggingface": {"path": str(path)}}, **trainer})
    )


def test_full_fine_tuning_does_the_6n_flops(model_dir):
    net = network(model_dir)
    assert net.flops_per_token(SEQ) == net.flops_6n(SEQ)
    layers, hidden = 2, net.module.config.hidden_size
    assert net.flops_per_token(SEQ) == 6 * linear_params(net.module) + 12 * layers * hidden * SEQ


def test_lora_does_fewer_flops_than_6n_by_the_frozen_weights_gradients(model_dir):
    net = network(model_dir, lora={"r": 4})
    frozen, trained = linear_params(net.module, trainable=False), linear_params(net.module, trainable=True)
    assert trained > 0 and frozen > 0
    # Each frozen weight skips its weight-gradient matmul: 2 FLOPs per parameter and token.
    assert net.flops_6n(SEQ) - net.flops_per_token(SEQ) == 2 * frozen


def test_the_meter_reports_both_mfus_and_the_same_one_twice_without_frozen_weights():
    meter = Meter(100.0, torch.device("cpu"), world=2, flops_6n=150.0)
    meter.peak = 1e6  # a device whose peak is known (CPUs have none: both are then None)
    meter.add(1000)
    rec = meter.flush(step=1, loss=1.0, lr=0.1, grad_norm=None)
    assert rec["mfu"] > 0 and rec["mfu_6n"] == pytest.approx(1.5 * rec["mfu"], rel=1e-3)
    plain = Meter(100.0, torch.device("cpu"), world=1)
    plain.peak = 1e6
    plain.add(1000)
    rec = plain.flush(step=1, loss=1.0, lr=0.1, grad_norm=None)
    assert rec["mfu"] == rec["mfu_6n"]
    cpu = Meter(100.0, torch.device("cpu"), world=1).flush(step=1, loss=1.0, lr=0.1, grad_norm=None)
    assert cpu["mfu"] is None and cpu["mfu_6n"] is None
