"""The network a config names: a built-in preset, or a Hugging Face model (transformers imported only then)."""

from __future__ import annotations

from sharded_api.config import TrainerConfig
from sharded_trainer.modeling.decoder import Network, preset_network


def build_network(cfg: TrainerConfig) -> Network:
    if cfg.model.huggingface is None:
        return preset_network(cfg)
    from sharded_trainer.modeling.hf import build_hf

    return build_hf(cfg)
