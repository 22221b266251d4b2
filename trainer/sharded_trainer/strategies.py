"""The strategy a config names: FSDP2 or ZeRO-2, each importing its framework only when chosen."""

from __future__ import annotations

from sharded_trainer.config import TrainerConfig
from sharded_trainer.model import Network
from sharded_trainer.parallel import Strategy
from sharded_trainer.process_group import DistEnv


def strategy_class(name: str) -> type[Strategy]:
    """The implementation of `strategy.type`."""
    if name == "fsdp":
        from sharded_trainer.fsdp import FsdpStrategy

        return FsdpStrategy
    from sharded_trainer.zero2 import Zero2Strategy

    return Zero2Strategy


def build_strategy(net: Network, cfg: TrainerConfig, env: DistEnv) -> Strategy:
    return strategy_class(cfg.strategy.type)(net, cfg, env)
