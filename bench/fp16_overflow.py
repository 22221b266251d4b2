"""ZeRO-2 fp16 dynamic loss scaling under an overflow, shown on a GPU (DeepSpeed refuses fp16 on CPU).

Runs the trainer exactly as `python -m sharded_trainer` does, with one change: on the steps named in
OVERFLOW_STEPS (comma-separated), a gradient hook turns one weight's gradient into inf, as an fp16
overflow would. Rank 0 prints one `OVERFLOW {...}` line per optimizer step with the skipped-step count,
the loss scale and a checksum of the fp16 weights, before and after the step; `--check` reads those
lines back and says whether each injected step was skipped (weights unchanged, counter +1, the scale not
raised: DeepSpeed's hysteresis of 2 halves it from the second overflow in a row) and every other step was
taken.

  OVERFLOW_STEPS=6,7 torchrun --standalone --nproc-per-node 1 bench/fp16_overflow.py --config fp16.yaml
  python bench/fp16_overflow.py --check run.log
"""

from __future__ import annotations

import json
import os
import sys

import torch


def checksum(model) -> float:
    with torch.no_grad():
        return float(sum(p.float().sum() for p in model.parameters()))


def install(steps: set[int]) -> None:
    from sharded_trainer.strategies.zero2 import Zero2Strategy

    step_once = Zero2Strategy.train_step

    def train_step(self, micro_batches):
        engine = self.engine
        step = engine.global_steps + 1  # DeepSpeed counts skipped steps too, and restores the count on load
        before = {"skipped": engine.skipped_steps, "scale": engine.optimizer.cur_scale, "sum": checksum(self.model)}
        handle = None
        if step in steps:  # the first weight's gradient overflows: DeepSpeed must find inf and skip the step
            weight = next(self.model.parameters())
            handle = weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        try:
            out = step_once(self, micro_batches)
        finally:
            if handle is not None:
                handle.remove()
        after = {"skipped": engine.skipped_steps, "scale": engine.optimizer.cur_scale, "sum": checksum(self.model)}
        if self.env.is_main:
            print("OVERFLOW " + json.dumps({"step": step, "injected": step in steps, "before": before, "after": after}),
                  flush=True)  # fmt: skip
        return out

    Zero2Strategy.train_step = train_step


def check(path: str) -> int:
    """Every injected step skipped (weights unchanged, counter +1, scale not raised); every other one taken."""
    with open(path) as f:
        rows = [json.loads(line.split(" ", 1)[1]) for line in f if line.startswith("OVERFLOW ")]
    bad = []
    for r in rows:
        b, a = r["before"], r["after"]
        skipped = a["skipped"] == b["skipped"] + 1 and a["sum"] == b["sum"] and a["scale"] <= b["scale"]
        taken = a["skipped"] == b["skipped"] and a["sum"] != b["sum"]
        if not (skipped if r["injected"] else taken):
            bad.append(r)
    injected = [r["step"] for r in rows if r["injected"]]
    scales = [rows[0]["before"]["scale"], *(r["after"]["scale"] for r in rows)] if rows else []
    halvings = sorted(set(scales), reverse=True)
    print(f"CHECK steps={len(rows)} injected={injected} final_skipped={rows[-1]['after']['skipped'] if rows else None} "
          f"loss_scales={halvings} {'ok' if rows and injected and not bad else 'FAILED'}")  # fmt: skip
    for r in bad:
        print("CHECK bad " + json.dumps(r))
    return 0 if rows and injected and not bad else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        sys.exit(check(sys.argv[2]))
    install({int(s) for s in os.environ.get("OVERFLOW_STEPS", "").split(",") if s})
    from sharded_trainer.__main__ import main

    sys.exit(main())
