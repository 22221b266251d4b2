"""The optimizer and the learning-rate schedule, the same for every strategy."""

from __future__ import annotations

import math

import torch

from sharded_api.config import OptimizerConfig, ScheduleConfig, TrainerConfig


def adamw_kwargs(o: OptimizerConfig) -> dict:
    """AdamW's hyperparameters, shared by torch's AdamW and DeepSpeed's CPU Adam."""
    return {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "weight_decay": o.weight_decay}


def make_optimizer(params, cfg: TrainerConfig, device: torch.device) -> torch.optim.Optimizer:
    if cfg.pure_bf16:
        return stochastic_adamw(params, cfg.optimizer, device)
    # Fused on the CPU too (torch has a fused CPU kernel): the loop of single-tensor updates costs every
    # parameter about twenty dispatches, through DTensor's under FSDP2 (a tiny model's step on CPU: 78 ms
    # single-tensor, 47 ms fused, the same losses).
    return torch.optim.AdamW(params, **adamw_kwargs(cfg.optimizer), fused=True)


def stochastic_adamw(params, o: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over bf16 weights: torchao's, which computes each update in fp32 and rounds the new weight to bf16
    stochastically (up with the probability of the dropped fraction), so the expected weight is the fp32 one.
    Rounded to nearest, an update under half of bf16's spacing (1/512 to 1/256 of the weight) is lost, and a
    small learning rate stops training. Its moments are bf16 too: 8 bytes per parameter in all.

    torchao compiles the step once per parameter shape; on a CPU (tests, CI) that is a C++ build per shape,
    longer than the run, so there the same function runs eagerly."""
    # torchao 0.18 exports it as `_AdamW` (in its __all__; its documented name for bf16 stochastic rounding).
    from torchao.optim import _AdamW

    class EagerOnCpu(_AdamW):
        def step(self, closure=None):
            with torch._dynamo.config.patch(disable=True):
                return super().step(closure)

    return (_AdamW if device.type == "cuda" else EagerOnCpu)(params, **adamw_kwargs(o), bf16_stochastic_round=True)


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
