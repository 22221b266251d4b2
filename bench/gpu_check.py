"""GPU correctness check: both strategies train with nccl on every visible GPU, stop on SIGTERM with a
checkpoint, and resume from it to the end. Prints one summary line per strategy.

    python bench/gpu_check.py --out DIR [--preset llama-125m] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from sharded_api.contract import CONFIG_FILE


def launch(config: Path, log: Path) -> subprocess.Popen:
    procs = f"--nproc-per-node={torch.cuda.device_count()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", procs, "-m", "sharded_trainer"]
    out = open(log, "w")  # noqa: SIM115 - handed to the child
    cmd += ["--config", str(config)]
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def metrics(log: Path) -> list[dict]:
    return [json.loads(line[8:]) for line in log.read_text().splitlines() if line.startswith("METRICS ")]


def check(strategy: str, args, out: Path) -> dict:
    work = out / strategy
    work.mkdir(parents=True, exist_ok=True)
    cfg = {
        "model": {"preset": args.preset}, "data": {"source": "learnable"}, "steps": args.steps,
        "microBatchSize": 8, "seqLen": 512, "precision": "bf16", "backend": "nccl",
        "optimizer": {"lr": 1e-3}, "schedule": {"warmupSteps": 5}, "logEvery": 5,
        "strategy": {"type": strategy},
        "checkpoint": {"dir": str(Path("/tmp/gpu-check-ckpt") / strategy), "interval": 10, "keepLast": 2},
        "progressFile": str(work / "progress.json"),
    }  # fmt: skip
    config = work / CONFIG_FILE
    config.write_text(yaml.safe_dump(cfg))
    first = launch(config, work / "run1.log")
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and first.poll() is None:
        p = work / "progress.json"
        if p.exists() and json.loads(p.read_text()).get("step", 0) >= args.steps // 2:
            os.killpg(first.pid, signal.SIGTERM)  # as the kubelet does on pod deletion
            break
        time.sleep(0.2)
    first.wait(timeout=300)
    second = launch(config, work / "run2.log")
    rc2 = second.wait(timeout=600)
    m1, m2 = metrics(work / "run1.log"), metrics(work / "run2.log")
    pre = next((m for m in m1 if m.get("event") == "preempted"), None)
    res = next((m for m in m2 if m.get("event") == "resumed"), None)
    fin = next((m for m in m2 if m.get("event") == "finished"), None)
    losses = [m for m in m1 + m2 if "loss" in m]
    return {
        "strategy": strategy, "gpus": torch.cuda.device_count(), "gpu": torch.cuda.get_device_name(0),
        "preempted_at": pre and pre["step"], "resumed_at": res and res["step"], "finished_at": fin and fin["step"],
        "second_run_rc": rc2, "first_loss": losses[0]["loss"] if losses else None,
        "last_loss": losses[-1]["loss"] if losses else None,
        "tokens_per_s_per_device": losses[-1].get("tokens_per_s_per_device") if losses else None,
        "peak_alloc_gib": losses[-1].get("peak_alloc_gib") if losses else None,
        "ok": bool(pre and res and fin and res["step"] == pre["step"] and rc2 == 0
                   and losses[-1]["loss"] < losses[0]["loss"]),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="llama-125m")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    results = [check(s, args, args.out) for s in ("fsdp", "zero2")]
    for r in results:
        print("GPU_CHECK " + json.dumps(r), flush=True)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
