"""The peer of bench/dpo_pairs.sh: TRL's DPOTrainer (what a user of TRL runs) on the same model directory and
preference records: bf16 weights loaded with from_pretrained (sdpa), peft LoRA r16 on every linear layer of the
decoder, the reference the base with the adapters off (TRL's default with peft), fused AdamW, no gradient
clipping difference (TRL's default 1.0, as the trainer's), one GPU.

    python bench/dpo_peer_trl.py MODEL_DIR RECORDS PAIRS_PER_STEP SEQ [STEPS] [checkpointing|none]

Activation (gradient) checkpointing is on unless `none`: TRL's DPOConfig turns it on by default.

Prints one RESULT line: tokens/s (both rows of every pair, the median step after warm-up) and peak memory."""

import json
import statistics
import sys
import time

import torch
from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer

model_dir, records, pairs, seq = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
steps = int(sys.argv[5]) if len(sys.argv) > 5 else 20
checkpointing = (sys.argv[6] if len(sys.argv) > 6 else "checkpointing") != "none"


class Timer(TrainerCallback):
    def __init__(self):
        self.t, self.times = None, []

    def on_step_begin(self, args, state, control, **kw):
        sync()
        self.t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        sync()
        self.times.append(time.perf_counter() - self.t)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=[
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])  # fmt: skip
args = DPOConfig(output_dir="/tmp/trl-dpo-out", per_device_train_batch_size=pairs, max_steps=steps, bf16=True,
                 learning_rate=1e-5, logging_steps=1000, save_strategy="no", report_to=[], beta=0.1,
                 loss_type=["sigmoid"], max_length=seq + 1, optim="adamw_torch_fused", dataloader_num_workers=2,
                 use_cpu=not torch.cuda.is_available(), gradient_checkpointing=checkpointing)  # fmt: skip
timer = Timer()
data, tokenizer = load_dataset("json", data_files=records, split="train"), AutoTokenizer.from_pretrained(model_dir)
trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, peft_config=lora,
                     callbacks=[timer])  # fmt: skip
trainer.train()
step = statistics.median(timer.times[steps // 3 :])
result = {
    "impl": "trl-dpo", "checkpointing": checkpointing, "pairs": pairs, "seq": seq, "step_s": round(step, 4),
    "tok_s_gpu": round(2 * pairs * seq / step),
    "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
    "torch": torch.__version__, "trl": __import__("trl").__version__,
    "transformers": __import__("transformers").__version__,
}  # fmt: skip
print("RESULT " + json.dumps(result), flush=True)
