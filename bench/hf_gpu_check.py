"""Fine-tuning correctness on a GPU: the tiny chat task (hack/tinyhf.py) fine-tuned in bf16 through the
trainer (full FSDP2, LoRA FSDP2, LoRA ZeRO-2, QLoRA under each, each exported at the end), then each export
loaded with transformers/peft and asked the task's 40 questions. Prints one `CHECK {...}` line per run.

    python bench/hf_gpu_check.py --out DIR [--procs 1] [--runs qlora-fsdp,...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hack"))
import tinyhf
from sharded_api.contract import CONFIG_FILE

RUNS = {
    "full-fsdp": {"strategy": {"type": "fsdp"}},
    "lora-fsdp": {"strategy": {"type": "fsdp"}, "lora": {"r": 8, "alpha": 16}},
    "lora-zero2": {"strategy": {"type": "zero2"}, "lora": {"r": 8, "alpha": 16}},
    "qlora-fsdp": {"strategy": {"type": "fsdp"}, "lora": {"r": 8, "alpha": 16, "quantizeBase": "nf4"}},
    "qlora-zero2": {"strategy": {"type": "zero2"}, "lora": {"r": 8, "alpha": 16, "quantizeBase": "nf4"}},
}


def answers(export: Path, base: Path, lora: bool) -> int:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(export if not lora else base))
    if lora:
        model = PeftModel.from_pretrained(model, str(export))
    tokenizer = AutoTokenizer.from_pretrained(str(export))
    return sum(tinyhf.greedy_answer(model, tokenizer, k) == tinyhf.answer(k) for k in range(len(tinyhf.WORDS)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--runs", default=",".join(RUNS))
    a = ap.parse_args()
    out = Path(a.out)
    base = tinyhf.write_model(out / "model", "llama")
    tinyhf.write_chat_data(out / "chat.jsonl", 400)
    for name in a.runs.split(","):
        extra = RUNS[name]
        cfg = {
            "model": {"huggingface": {"path": str(base)}},
            "data": {"source": "jsonl", "path": str(out / "chat.jsonl"), "evalFraction": 0.1, "evalEvery": 30},
            "steps": 60, "microBatchSize": 8, "seqLen": 64, "precision": "bf16", "logEvery": 10,
            "optimizer": {"lr": 0.01, "weightDecay": 0.0}, "schedule": {"warmupSteps": 2},
            "checkpoint": {"dir": str(out / name / "ckpt"), "interval": 30}, "exportOnSuccess": True, **extra,
        }  # fmt: skip
        (out / name).mkdir(parents=True, exist_ok=True)
        path = out / name / CONFIG_FILE
        path.write_text(json.dumps(cfg))
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={a.procs}", "-m", "sharded_trainer",
             "--config", str(path)],
            capture_output=True, text=True, env={**os.environ},
        )  # fmt: skip
        metrics = [json.loads(line[8:]) for line in proc.stdout.splitlines() if line.startswith("METRICS ")]
        last = [m for m in metrics if "loss" in m and "step" in m][-1:] or [{}]
        evals = [m["eval_loss"] for m in metrics if m.get("event") == "eval"]
        right = answers(out / name / "ckpt" / "export", base, "lora" in extra) if proc.returncode == 0 else None
        rec = {
            "run": name,
            "rc": proc.returncode,
            "loss": last[0].get("loss"),
            "eval_loss": evals[-1:] or None,
            "peak_alloc_gib": last[0].get("peak_alloc_gib"),
            "answers_right": right,
            "of": len(tinyhf.WORDS),
        }
        print("CHECK " + json.dumps(rec), flush=True)
        if proc.returncode:
            print(proc.stderr[-3000:], flush=True)


if __name__ == "__main__":
    main()
