"""The project's trainer measured the way bench/reference_fsdp_zero2.py measures the reference.

Runs under torchrun. Builds the model, strategy and data loader exactly as `python -m sharded_trainer`
does and times `strategy.train_step` (synchronized, median after warm-up), then prints one RESULT
line with the reference's fields. `--ckpt DIR` instead measures checkpoint cost: a raw fsync'd write of
this rank's state bytes, a synchronous save, an asynchronous save (FSDP; the stall is the time until
training may continue) and a load, all through CheckpointManager.

  torchrun --nproc-per-node 2 bench/bench_trainer.py --strategy fsdp [--compile] [--batch 8]
  torchrun --nproc-per-node 2 bench/bench_trainer.py --strategy fsdp --ckpt /tmp/ckpt
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from sharded_api.config import TrainerConfig
from sharded_trainer.checkpoint.manager import CheckpointManager
from sharded_trainer.data.sources import ShardedLoader, TokenSource
from sharded_trainer.modeling.decoder import preset_network
from sharded_trainer.process_group import init_distributed
from sharded_trainer.strategies.pick import build_strategy


def config(a) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "model": {"preset": a.preset},
            "data": {"source": "synthetic"},
            "steps": 10_000,
            "microBatchSize": a.batch,
            "seqLen": a.seq,
            "precision": a.precision,
            "gradClipNorm": a.clip,  # the reference does not clip; 0 measures the same work
            "schedule": {"warmupSteps": 10},
            "strategy": {"type": a.strategy, a.strategy: strategy_options(a)},
            "backend": "nccl",
            "checkpoint": {"dir": a.ckpt, "keepLast": 10, "async": False},
        }
    )


def strategy_options(a) -> dict:
    options: dict = {"compile": a.compile}
    if a.no_reshard:
        options["reshardAfterForward"] = False
    for item in a.option:  # KEY=VALUE of the strategy's options, as in a job's spec (camelCase)
        key, _, value = item.partition("=")
        options[key] = yaml.safe_load(value)
    return options


def attention_backends(name: str):
    """A context that puts one SDPA backend first (it must cover compilation, which picks the kernel)."""
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    first = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[name]
    rest = [b for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH) if b != first]
    return sdpa_kernel([first, *rest], set_priority=True)


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def local_state_bytes(strategy) -> int:
    """Bytes of this rank's shard of model + optimizer state (what a raw write of the same size writes)."""
    total = 0
    tensors = list(strategy.model.parameters())
    opt = getattr(strategy, "optimizer", None) or strategy.engine.optimizer
    for st in opt.state.values():
        tensors += [v for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    if hasattr(opt, "single_partition_of_fp32_groups"):  # ZeRO-2's fp32 master partition
        tensors += list(opt.single_partition_of_fp32_groups)
    for t in tensors:
        t = t._local_tensor if hasattr(t, "_local_tensor") else t
        total += t.numel() * t.element_size()
    return total


def timed(fn) -> float:
    torch.cuda.synchronize()
    dist.barrier()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def bench_checkpoint(a, cfg, env, strategy, loader, rank0: bool) -> dict:
    root = Path(a.ckpt)
    if rank0:
        shutil.rmtree(root, ignore_errors=True)
        (root / "raw").mkdir(parents=True)
    dist.barrier()
    nbytes = local_state_bytes(strategy)
    buf = torch.empty(nbytes, dtype=torch.uint8).numpy()

    def raw():
        with open(root / "raw" / f"r{env.rank}.bin", "wb") as f:
            f.write(memoryview(buf))
            f.flush()
            os.fsync(f.fileno())
        dist.barrier()

    res: dict = {"strategy": a.strategy, "world": env.world, "bytes_total": nbytes * env.world}
    state = {"data": loader.state_dict(), "loss": 0.0}
    mgr = CheckpointManager(cfg.checkpoint, env, total_steps=10_000)
    gb = res["bytes_total"] / 1e9
    if not a.async_only:
        res["raw_s"] = timed(raw)
        if rank0:
            shutil.rmtree(root / "raw", ignore_errors=True)
        res["sync_save_s"] = timed(lambda: (mgr.save(1, strategy, state, force=True), dist.barrier()))
        res["saved_bytes"] = dir_bytes(root / "step-00000001") if rank0 else 0
        res.update(raw_GBps=gb / res["raw_s"], save_GBps=gb / res["sync_save_s"])
        res["save_vs_raw"] = res["save_GBps"] / res["raw_GBps"]
    if a.strategy == "fsdp":
        mgr.cfg = cfg.checkpoint.model_copy(update={"async_save": True, "interval": 1})
        # The first asynchronous save also creates the background group and pins host buffers; the
        # second reuses both, as every later save of a run does.
        for step, key in ((2, "async"), (3, "async_steady")):
            torch.cuda.synchronize()
            dist.barrier()
            t = time.perf_counter()
            mgr.save(step, strategy, state)  # returns once training may go on
            res[f"{key}_stall_s"] = time.perf_counter() - t
            strategy.train_step([loader.next_batch()])  # training goes on while the write runs
            mgr.wait()
            dist.barrier()
            res[f"{key}_total_s"] = time.perf_counter() - t
            res[f"{key}_GBps"] = gb / res[f"{key}_total_s"]
    if not a.async_only:
        res["load_s"] = timed(lambda: (mgr.load_latest(strategy), dist.barrier()))
        res["load_GBps"] = gb / res["load_s"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", choices=["fsdp", "zero2"], required=True)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--ckpt", default=None, help="measure checkpoint cost under this directory instead")
    ap.add_argument("--async-only", action="store_true", help="with --ckpt: only the two asynchronous saves")
    ap.add_argument("--no-reshard", action="store_true", help="FSDP: keep blocks gathered from forward to backward")
    ap.add_argument("--sdpa", choices=["default", "cudnn", "flash"], default="default", help="attention backend first")
    ap.add_argument(
        "--option",
        action="append",
        default=[],
        help="a strategy option KEY=VALUE (repeatable), "
        "e.g. activationCheckpointing=true, cpuOffload=true, prefetch=2, shard=hybrid",
    )
    ap.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    a = ap.parse_args()

    cfg = config(a)
    env = init_distributed("nccl")
    net = preset_network(cfg)
    fpt, nparams = net.flops_per_token(cfg.seq_len), sum(p.numel() for p in net.module.parameters())
    strategy = build_strategy(net, cfg, env)
    loader = ShardedLoader(
        TokenSource(cfg.data, net.vocab_size, cfg.seq_len), micro_batch=cfg.micro_batch_size,
        rank=env.rank, world=env.world,
    )  # fmt: skip
    rank0 = env.rank == 0
    if a.ckpt:
        for _ in range(3):  # optimizer state exists only after a step
            strategy.train_step([loader.next_batch()])
        res = bench_checkpoint(a, cfg, env, strategy, loader, rank0)
        if rank0:
            print("CKPT " + json.dumps(res), flush=True)
        dist.destroy_process_group()
        return

    torch.cuda.reset_peak_memory_stats()
    times, loss = [], 0.0
    with attention_backends(a.sdpa):
        for _ in range(a.steps):
            batch = loader.next_batch()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss, _ = strategy.train_step([batch])
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    med = statistics.median(times[max(5, a.steps // 3) :])
    tps = a.batch * a.seq / med
    res = dict(
        impl="trainer", strategy="fsdp2" if a.strategy == "fsdp" else "zero2", compile=a.compile, world=env.world,
        seq=a.seq, batch=a.batch, params=nparams, step_s=round(med, 4), tok_s_gpu=round(tps),
        mfu=round(fpt * tps / 989e12, 4), loss=round(float(loss), 3), sdpa=a.sdpa, reshard=not a.no_reshard,
        options=a.option, precision=a.precision,
        peak_alloc_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
        peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2), gpu=torch.cuda.get_device_name(),
    )  # fmt: skip
    if rank0:
        print("RESULT " + json.dumps(res), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
