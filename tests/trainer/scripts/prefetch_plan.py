"""Apply FSDP2 to a 12-block model in a world of one for each `prefetch` value and print, per value, how many
blocks each block prefetches forward and backward (what FSDP2 was told, read back from its state)."""

from __future__ import annotations

import json

import torch

from sharded_api.config import TrainerConfig
from sharded_trainer.modeling.decoder import build_model
from sharded_trainer.process_group import init_distributed, shutdown
from sharded_trainer.strategies.fsdp import apply_fsdp
from sharded_trainer.strategies.parallel import DTYPES

env = init_distributed("gloo")
plans = {}
for prefetch in range(5):
    cfg = TrainerConfig.model_validate({"model": {"preset": "llama-125m", "vocabSize": 256}, "precision": "fp32",
                                        "strategy": {"fsdp": {"prefetch": prefetch}}})  # fmt: skip
    with torch.device("meta"):  # the plan needs the blocks, not their weights
        model = build_model(cfg)
    model = apply_fsdp(model, mesh=None, options=cfg.strategy.fsdp, param_dtype=DTYPES["fp32"])
    blocks = [m for m in model.modules() if m is not model and hasattr(m, "set_modules_to_forward_prefetch")]
    states = [b._get_fsdp_state() for b in blocks]
    plans[prefetch] = {
        "forward": [len(s._states_to_forward_prefetch) for s in states],
        "backward": [len(s._states_to_backward_prefetch) for s in states],
    }
    del model, blocks, states
print("PLAN " + json.dumps(plans), flush=True)
shutdown()
