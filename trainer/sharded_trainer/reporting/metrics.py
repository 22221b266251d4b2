"""Throughput, MFU and memory as JSON lines on stdout (`METRICS {...}`), for people and log scrapers."""

from __future__ import annotations

import json
import sys
import time

import torch

# Dense bf16 peak FLOP/s per device, for MFU. Unknown devices (and CPUs) report no MFU.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


class Meter:
    """Accumulates tokens between log lines and turns them into tokens/s per device and MFU."""

    def __init__(self, flops_per_token: float, device: torch.device, world: int, flops_6n: float | None = None):
        self.flops_per_token = flops_per_token
        self.flops_6n = flops_per_token if flops_6n is None else flops_6n
        self.device, self.world = device, world
        self.peak = peak_flops(device)
        self.tokens = 0
        self.t0 = time.perf_counter()

    def add(self, tokens_this_rank: int) -> None:
        self.tokens += tokens_this_rank

    def flush(self, step: int, loss: float, lr: float, grad_norm: float | None) -> dict:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        tps = self.tokens / elapsed
        rec = {
            "step": step,
            "loss": round(loss, 5),
            "lr": lr,
            "grad_norm": None if grad_norm is None else round(grad_norm, 4),
            "tokens_per_s_per_device": round(tps, 1),
            "tokens_per_s": round(tps * self.world, 1),
            # Two labelled MFUs: from the FLOPs done, and by the 6·N convention (equal unless weights are frozen).
            "mfu": round(tps * self.flops_per_token / self.peak, 4) if self.peak else None,
            "mfu_6n": round(tps * self.flops_6n / self.peak, 4) if self.peak else None,
        }
        if self.device.type == "cuda":
            rec["peak_alloc_gib"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)
            rec["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(self.device) / 2**30, 2)
        self.tokens, self.t0 = 0, time.perf_counter()
        return rec


def emit(record: dict) -> None:
    """One JSON line on stdout, tagged so log scrapers can find it among other output; `time` (Unix seconds)
    lets a recovery be timed from the logs (bench/recovery.py)."""
    sys.stdout.write("METRICS " + json.dumps({**record, "time": round(time.time(), 3)}) + "\n")
    sys.stdout.flush()
