"""Under torchrun: build a QLoRA job's sharded model as the trainer does (each rank quantizing only its rows),
then rank 0 compares every NF4 weight, all-gathered the way FSDP2 gathers it for compute, with quantizing
the whole weight from the model's files in one piece, and writes what it found to --out (JSON)."""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

from sharded_api.loading import load_config
from sharded_trainer.modeling.build import build_network
from sharded_trainer.modeling.hf import SafetensorsWeights, checkpoint_key
from sharded_trainer.modeling.quantize import is_nf4, nf4_bytes
from sharded_trainer.process_group import init_distributed, shutdown
from sharded_trainer.strategies.pick import build_strategy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("--out")
    args = parser.parse_args(sys.argv[1:])
    cfg = load_config(args.config)
    env = init_distributed(cfg.backend)
    probe(cfg, env, args.out)
    dist.barrier()


def probe(cfg, env, out: str) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    strategy = build_strategy(build_network(cfg), cfg, env)
    files = SafetensorsWeights(cfg.model.huggingface.path)
    found = {}
    for prefix, module in strategy.model.named_modules():
        if not isinstance(module, FSDPModule) or module is strategy.model:
            continue
        module.unshard()  # the all-gather of the packed 4-bit data that every forward does
        for name, p in module.named_parameters(prefix=prefix):
            if not is_nf4(p):
                continue
            original = files.read(checkpoint_key(name), None, p.dtype)
            whole = to_nf4(original, p.block_size, p.scaler_block_size).get_original_weight()
            gathered = p.get_original_weight()
            found[checkpoint_key(name)] = {
                "shape": list(p.shape), "block": p.block_size, "scalerBlock": p.scaler_block_size,
                "vsWhole": (gathered.float() - whole.float()).abs().max().item(),
                "vsOriginal": ((gathered.float() - original.float()).norm() / original.float().norm()).item(),
            }  # fmt: skip
        module.reshard()
    total = torch.tensor([nf4_bytes(strategy.model)])
    dist.all_reduce(total)
    if env.rank == 0:
        dense = sum(v["shape"][0] * v["shape"][1] * 2 for v in found.values())  # the same weights in bf16
        with open(out, "w") as f:
            json.dump({"weights": found, "nf4Bytes": total.item(), "bf16Bytes": dense, "world": env.world}, f)


if __name__ == "__main__":
    try:
        main()
    finally:
        shutdown()
