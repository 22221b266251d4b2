"""The strategy a config names: FSDP2 or ZeRO-2, each importing its framework only when chosen."""

from __future__ import annotations

from sharded_api.config import TrainerConfig
from sharded_trainer.modeling.decoder import Network
from sharded_trainer.process_group import DistEnv
from sharded_trainer.strategies.parallel import Strategy


def strategy_class(name: str) -> type[Strategy]:
    """The implementation of `strategy.type`."""
    if name == "fsdp":
        from sharded_trainer.strategies.fsdp import FsdpStrategy

        return FsdpStrategy
    from sharded_trainer.strategies.zero2 import Zero2Strategy

    return Zero2Strategy


def build_strategy(net: Network, cfg: TrainerConfig, env: DistEnv) -> Strategy:
    return strategy_class(cfg.strategy.type)(net, cfg, env)
