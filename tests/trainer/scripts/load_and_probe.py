"""Under torchrun: load a checkpoint into the sharded strategy, then rank 0 saves full weights and logits;
or, with --resave DIR, every rank saves the loaded state again at once into DIR, untouched by any step, so
the two checkpoints can be compared state for state."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from sharded_api.loading import load_config
from sharded_trainer.checkpoint.manager import step_dir
from sharded_trainer.modeling.decoder import preset_network
from sharded_trainer.process_group import init_distributed, shutdown
from sharded_trainer.strategies.pick import build_strategy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("--step", type=int)
    parser.add_argument("--out")
    parser.add_argument("--resave")
    args = parser.parse_args(sys.argv[1:])

    cfg = load_config(args.config)
    env = init_distributed(cfg.backend)
    probe(cfg, env, args.step, args.out, args.resave)
    dist.barrier()


def probe(cfg, env, step: int, out: str, resave: str | None) -> None:
    """Load, run and save. Everything sharded lives in this frame, so it is freed before the process group
    goes: objects left alive until interpreter shutdown can abort it from their destructors."""
    strategy = build_strategy(preset_network(cfg), cfg, env)
    strategy.load(step_dir(Path(cfg.checkpoint.dir), step))
    if resave:
        Path(resave).mkdir(parents=True, exist_ok=True)
        strategy.save(Path(resave), async_save=False)
        return
    tokens = (torch.arange(2 * cfg.seq_len).reshape(2, cfg.seq_len) * 7) % 64
    with torch.no_grad():
        logits = strategy.model(tokens)
    if cfg.strategy.type == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(strategy.model, options=options)
    else:
        weights = {k: v.detach().float().cpu() for k, v in strategy.model.state_dict().items()}
    if env.rank == 0:
        torch.save({"logits": logits.float().cpu(), "weights": weights, "world": env.world}, out)


if __name__ == "__main__":
    try:
        main()
    finally:
        shutdown()
