"""A plain Hugging Face Trainer script, run by the operator through `spec.command`, that keeps the operator's
features: progress and eval loss in the job's status, hang detection, and a checkpoint on suspend, drain or
preemption that the next start resumes from. It reads what to train from the job's `spec.trainer` section
(model.huggingface.path, data.path with chat `messages` records, steps, microBatchSize, seqLen, optimizer.lr,
checkpoint interval) and writes its checkpoints to the job's claim.

    kubectl create configmap hf-trainer-script --from-file=examples/hf_trainer_script.py
    kubectl apply -f examples/hf-trainer-script.yaml

Locally: torchrun --nproc-per-node 2 examples/hf_trainer_script.py --config trainer.yaml
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import sharded_trainer
from sharded_trainer.hf_callback import ShardedCallback


class ChatRecords(torch.utils.data.Dataset):
    """Chat records tokenized with the model's chat template, padded to seqLen (the whole conversation is
    trained on: the bundled trainer's data.responseOnlyLoss and packing are not used here)."""

    def __init__(self, path: str, tokenizer, seq_len: int):
        self.rows = []
        with open(path) as f:
            for line in f:
                text = tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=False)
                ids = tokenizer(text, add_special_tokens=False)["input_ids"][:seq_len]
                pad = seq_len - len(ids)
                labels = ids + [-100] * pad
                self.rows.append({"input_ids": ids + [tokenizer.pad_token_id] * pad, "labels": labels,
                                  "attention_mask": [1] * len(ids) + [0] * pad})  # fmt: skip

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {k: torch.tensor(v) for k, v in self.rows[i].items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", help="trainer config (default: the one the operator mounts)")
    cfg = sharded_trainer.job_config(parser.parse_args().config)
    model_dir, out = cfg.model.huggingface.path, cfg.checkpoint.dir
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cpu = not torch.cuda.is_available()
    args = TrainingArguments(
        output_dir=out, max_steps=cfg.steps, per_device_train_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.grad_accum_steps, learning_rate=cfg.optimizer.lr,
        weight_decay=cfg.optimizer.weight_decay, warmup_steps=cfg.schedule.warmup_steps,
        logging_steps=cfg.log_every, save_steps=cfg.checkpoint.interval, save_total_limit=cfg.checkpoint.keep_last,
        bf16=cfg.precision == "bf16" and not cpu, use_cpu=cpu, ddp_backend="gloo" if cpu else None,
        report_to=[], seed=cfg.seed, data_seed=cfg.data.seed, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=args, train_dataset=ChatRecords(cfg.data.path, tokenizer, cfg.seq_len),
        callbacks=[ShardedCallback()],
    )  # fmt: skip
    last = get_last_checkpoint(out) if out and os.path.isdir(out) else None  # the stop's checkpoint, or a periodic one
    trainer.train(resume_from_checkpoint=last)
    if sharded_trainer.stop_requested():
        sharded_trainer.exit_stopped()  # after the checkpoint the callback asked for: the job resumes from it
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # every rank passed the callback's last barrier


if __name__ == "__main__":
    main()
