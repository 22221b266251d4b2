"""The optimizer and the learning-rate schedule, the same for every strategy."""

from __future__ import annotations

import math

import torch

from sharded_api.config import OptimizerConfig, ScheduleConfig, TrainerConfig


def adamw_kwargs(o: OptimizerConfig) -> dict:
    """AdamW's hyperparameters, shared by torch's AdamW and DeepSpeed's CPU Adam."""
    return {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "weight_decay": o.weight_decay}


def make_optimizer(params, cfg: TrainerConfig, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, **adamw_kwargs(cfg.optimizer), fused=device.type == "cuda")


def lr_lambda(schedule: ScheduleConfig, total_steps: int):
    """Linear warmup to the peak, then cosine/linear decay to min_lr_ratio (a pure function of the step)."""

    def f(step: int) -> float:
        if step < schedule.warmup_steps:
            return (step + 1) / (schedule.warmup_steps + 1)
        if schedule.decay == "constant":
            return 1.0
        progress = min(1.0, (step - schedule.warmup_steps) / max(1, total_steps - schedule.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule.decay == "cosine" else 1 - progress
        return schedule.min_lr_ratio + (1 - schedule.min_lr_ratio) * shape

    return f


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainerConfig) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.schedule, cfg.steps))
