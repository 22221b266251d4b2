"""Profile any training script, unchanged, under torchrun: the project's trainer or the reference.

    torchrun --nproc-per-node 2 bench/profile_run.py --out DIR --label NAME [--skip 12] [--active 3] \
        SCRIPT [SCRIPT ARGS...]

The script runs as `__main__` (its own timing and RESULT line included). The profiler counts training
steps by a global optimizer-step hook, which every optimizer, DeepSpeed's included, fires once per
step: it skips `--skip` steps (compilation and warm-up), records `--active` steps, and then rank 0
writes `profile-NAME.txt`: GPU kernel time per kind and step, then torch's kernel table. It prints one
`PROFILE {...}` line. Recording slows those steps, so the script's own timing must use steps outside
them (the default skips 12 of the 20 steps, after the first third that the timing drops, and the
timing's median shifts little).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule

from sharded_api.contract import WorkerEnv

# Without a GPU (CI) the same flow profiles CPU operators.
DEVICE = "CUDA" if torch.cuda.is_available() else "CPU"
KERNEL_KINDS = (  # first match wins; kernel names as cuBLAS, cuDNN, NCCL, Triton and ATen give them
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "aten::mm", "aten::addmm", "aten::bmm")),
    ("optimizer", ("adam",)),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, needles in KERNEL_KINDS:
        if any(n in low for n in needles):
            return kind
    return "elementwise/other"


def summarize(prof, steps: int, step_s: float, label: str) -> dict:
    """Kernel time per kind and step. Only kernels count: GPU-side annotations (`nccl:all_gather...`)
    span the kernels they name, and CPU operators report their kernels' time as their own."""
    kinds: dict[str, float] = {}
    for ev in prof.key_averages():
        us = (ev.self_device_time_total if DEVICE == "CUDA" else ev.self_cpu_time_total) or 0
        annotation = getattr(ev, "is_user_annotation", False) or ev.key.startswith("nccl:")
        if us > 0 and ev.device_type.name == DEVICE and not annotation:
            kinds[kernel_kind(ev.key)] = kinds.get(kernel_kind(ev.key), 0.0) + us / 1e3 / steps
    compute = sum(v for k, v in kinds.items() if k != "communication")
    return {
        "label": label, "step_ms": round(step_s * 1e3, 1), "compute_busy": round(compute / (step_s * 1e3), 3),
        "kernel_ms_per_step": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--skip", type=int, default=12)
    ap.add_argument("--active", type=int, default=3)
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()

    marks: list[float] = []

    def on_trace_ready(prof) -> None:
        steps = a.active
        step_s = (marks[-1] - marks[-1 - steps]) / steps if len(marks) > steps else float("nan")
        res = summarize(prof, steps, step_s, a.label)
        if int(os.environ.get(WorkerEnv.RANK, "0")) == 0:
            a.out.mkdir(parents=True, exist_ok=True)
            sort = "self_device_time_total" if DEVICE == "CUDA" else "self_cpu_time_total"
            table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70)
            (a.out / f"profile-{a.label}.txt").write_text(json.dumps(res) + "\n\n" + table)
            print("PROFILE " + json.dumps(res), flush=True)

    prof = profile(
        activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "CUDA" else []),
        schedule=schedule(wait=max(0, a.skip - 1), warmup=1, active=a.active, repeat=1),
        on_trace_ready=on_trace_ready,
    )

    def after_step(*_) -> None:
        if DEVICE == "CUDA":
            torch.cuda.synchronize()  # the step's kernels belong to this step's window
        marks.append(time.perf_counter())
        prof.step()

    register_optimizer_step_post_hook(after_step)
    sys.argv = [a.script, *a.args]
    with prof:
        runpy.run_path(a.script, run_name="__main__")


if __name__ == "__main__":
    main()
