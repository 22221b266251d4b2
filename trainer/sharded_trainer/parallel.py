"""FSDP2 and DeepSpeed ZeRO-2 applied to an unchanged model, behind one training-step interface."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from sharded_trainer.config import FsdpOptions, ScheduleConfig, TrainerConfig, Zero2Options
from sharded_trainer.dist import DistEnv

Batch = tuple[torch.Tensor, torch.Tensor]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy computed in fp32 from low-precision logits.

    The same values as upcasting the logits first (bf16 -> fp32 is exact), written so that compiling it
    pays off: eager, `log_softmax(..., dtype=float32)` still makes an fp32 copy of bf16 logits (ATen
    fuses the cast only for fp16), but the compiled graph reads the bf16 logits and writes their bf16
    gradient without any fp32 tensor of the logits' size, 1 GiB per 2048-token sequence at a 128k
    vocabulary.
    """
    log_probs = F.log_softmax(logits.flatten(0, 1), dim=-1, dtype=torch.float32)
    return F.nll_loss(log_probs, targets.flatten(0, 1))


def loss_function(compile: bool):
    """The cross-entropy, compiled when the blocks are: the log-softmax, loss and backward then fuse
    into two kernels that read the bf16 logits and write their bf16 gradient."""
    return torch.compile(cross_entropy, fullgraph=True) if compile else cross_entropy


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Queue the copy of a host batch without making the host wait for the GPU. A copy from pageable
    memory synchronizes the stream: the targets' copy, made after forward is queued, would hold the host
    until forward finished, and the GPU would then idle while backward is being queued."""
    if device.type != "cuda":
        return batch
    inputs, targets = (t.pin_memory().to(device, non_blocking=True) for t in batch)
    return inputs, targets


def make_optimizer(params, cfg: TrainerConfig, device: torch.device) -> torch.optim.Optimizer:
    o = cfg.optimizer
    return torch.optim.AdamW(
        params,
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        fused=device.type == "cuda",
    )


def mean_over_ranks(value: torch.Tensor, env: DistEnv) -> float:
    """The mean over ranks of a local value (gloo has no AVG reduction, so SUM / world). Synchronizes:
    call it when logging, not every step."""
    import torch.distributed as dist

    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / env.world


class Strategy(Protocol):
    """What the training loop needs from a parallelism; model code sees none of it."""

    model: nn.Module

    def train_step(self, micro_batches: Sequence[Batch]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward/backward every micro-batch, step the optimizer. Returns this rank's mean loss and the
        global gradient norm (None when not computed) as device tensors: reading them synchronizes."""

    def current_lr(self) -> float: ...

    def save(self, directory: Path, *, async_save: bool) -> object | None:
        """Write this rank's part of the model/optimizer/scheduler state; may return a pending future."""

    def load(self, directory: Path) -> None: ...


# --- FSDP2 --------------------------------------------------------------------------------------


def wrap_blocks(model: nn.Module, *, activation_checkpointing: bool, compile: bool) -> list[nn.Module]:
    """Apply activation checkpointing and torch.compile to each transformer block; return the blocks."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name, block in list(model.layers.items()):
        if activation_checkpointing:
            # The wrapper keeps parameter names clean in state dicts (DCP strips its prefix).
            block = checkpoint_wrapper(block, preserve_rng_state=False)
            model.layers[name] = block
        if compile:
            block.compile()  # in place, so parameter FQNs do not gain an `_orig_mod.` prefix
    return list(model.layers.values())


def apply_fsdp(model: nn.Module, *, mesh, options: FsdpOptions, param_dtype: torch.dtype) -> nn.Module:
    """Shard each transformer block, then the root (embeddings, final norm, output) with FSDP2.

    Blocks are sharded first so each one all-gathers and frees its own parameters around its compute;
    the root call then picks up whatever parameters no block owns (the tied embedding among them).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=DTYPES[options.reduce_dtype])
    if param_dtype == torch.float32:
        mp = MixedPrecisionPolicy()
    extra = {"offload_policy": CPUOffloadPolicy()} if options.cpu_offload else {}
    sharded = wrap_blocks(model, activation_checkpointing=options.activation_checkpointing, compile=options.compile)
    for block in sharded:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=options.reshard_after_forward, **extra)
    # The root's parameters are needed again at the start of backward: keep them gathered.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, **extra)
    if options.prefetch > 1:
        for i, block in enumerate(sharded):
            block.set_modules_to_forward_prefetch(sharded[i + 1 : i + 1 + options.prefetch])
            block.set_modules_to_backward_prefetch(list(reversed(sharded[max(0, i - options.prefetch) : i])))
    return model


def host_stager(device: torch.device):
    """DCP stager that copies the state into host buffers allocated once and reused by every save.

    On GPUs the buffers are pinned, so a save after the first is one device-to-host copy at full
    PCIe speed. (DCP's `DefaultStager` pins too, but torch 2.11 drops its buffers after each save, so
    every save would allocate and pin ~7 GB per rank again for a 1.2B model.) Pinned memory needs a
    GPU; on CPU each save copies into fresh host memory.
    """
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    return BlockingAsyncStager(cache_staged_state_dict=device.type == "cuda")


class FsdpStrategy:
    def __init__(self, model: nn.Module, cfg: TrainerConfig, env: DistEnv):
        from torch.distributed.device_mesh import init_device_mesh

        self.env, self.cfg = env, cfg
        self.mesh = init_device_mesh(env.device.type, (env.world,))
        self.model = apply_fsdp(model, mesh=self.mesh, options=cfg.strategy.fsdp, param_dtype=DTYPES[cfg.precision])
        self.loss = loss_function(cfg.strategy.fsdp.compile)
        self.optimizer = make_optimizer(self.model.parameters(), cfg, env.device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg.schedule, cfg.steps))
        self._ckpt_group = None
        self._stager = None

    def train_step(self, micro_batches: Sequence[Batch]) -> tuple[torch.Tensor, torch.Tensor | None]:
        total = torch.zeros((), device=self.env.device)
        for batch in micro_batches:
            inputs, targets = to_device(batch, self.env.device)
            loss = self.loss(self.model(inputs), targets)
            (loss / len(micro_batches)).backward()
            total += loss.detach()
        norm = None
        if self.cfg.grad_clip_norm > 0:  # the norm is a pass over every gradient plus an all-reduce
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip_norm)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return total / len(micro_batches), norm

    def current_lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "scheduler": self.scheduler.state_dict()}

    def save(self, directory: Path, *, async_save: bool) -> object | None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        state = self._state()
        if not async_save:
            dcp.save(state, checkpoint_id=str(directory))
            return None
        # Background writes run collectives off the training stream: give them their own gloo group.
        if self._ckpt_group is None:
            self._ckpt_group = dist.new_group(backend="gloo")
        if self._stager is None:
            self._stager = host_stager(self.env.device)
        # Returns once the state is copied to host memory (the training stall); the write to disk
        # then overlaps training. CheckpointManager starts a save only after the previous one has
        # finished, so the reused host buffers are never overwritten while being written out.
        response = dcp.async_save(
            state, checkpoint_id=str(directory), process_group=self._ckpt_group, async_stager=self._stager
        )
        return getattr(response, "upload_completion", response)

    def load(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()
        dcp.load(state, checkpoint_id=str(directory))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])


# --- DeepSpeed ZeRO-2 ---------------------------------------------------------------------------


def zero2_config(cfg: TrainerConfig, options: Zero2Options) -> dict:
    """The DeepSpeed config for ZeRO stage 2, derived from the trainer config (never written by hand)."""
    zero: dict = {
        "stage": 2,
        "overlap_comm": options.overlap_comm,
        "contiguous_gradients": options.contiguous_gradients,
        "reduce_bucket_size": options.reduce_bucket_size,
        "allgather_bucket_size": options.allgather_bucket_size,
        "reduce_scatter": True,
    }
    if options.cpu_offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum_steps,
        "gradient_clipping": cfg.grad_clip_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.precision == "bf16"},
        "fp16": {"enabled": cfg.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def apply_zero2(model: nn.Module, *, cfg: TrainerConfig, device: torch.device):
    """Wrap the model in a DeepSpeed engine with ZeRO-2 (sharded gradients and optimizer state)."""
    import deepspeed

    options = cfg.strategy.zero2
    wrap_blocks(model, activation_checkpointing=options.activation_checkpointing, compile=options.compile)
    model.to(device)
    if options.cpu_offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        o = cfg.optimizer
        optimizer = DeepSpeedCPUAdam(
            model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay
        )
    else:
        optimizer = make_optimizer(model.parameters(), cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.schedule, cfg.steps))
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=zero2_config(cfg, options),
        dist_init_required=False,
    )  # fmt: skip
    return engine


class Zero2Strategy:
    def __init__(self, model: nn.Module, cfg: TrainerConfig, env: DistEnv):
        import deepspeed

        deepspeed.init_distributed(dist_backend=env.backend, auto_mpi_discovery=False)
        self.env, self.cfg = env, cfg
        self.engine = apply_zero2(model, cfg=cfg, device=env.device)
        self.model = self.engine.module
        self.loss = loss_function(cfg.strategy.zero2.compile)

    def train_step(self, micro_batches: Sequence[Batch]) -> tuple[torch.Tensor, torch.Tensor | None]:
        total = torch.zeros((), device=self.env.device)
        for batch in micro_batches:
            inputs, targets = to_device(batch, self.env.device)
            loss = self.loss(self.engine(inputs), targets)
            self.engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
            self.engine.step()  # steps optimizer and scheduler only at the accumulation boundary
            total += loss.detach()
        norm = self.engine.get_global_grad_norm()
        return total / len(micro_batches), None if norm is None else torch.as_tensor(norm)

    def current_lr(self) -> float:
        return self.engine.get_lr()[0]

    def save(self, directory: Path, *, async_save: bool) -> object | None:
        # DeepSpeed's own format: it knows how its partitioned optimizer state is laid out.
        self.engine.save_checkpoint(str(directory), tag="zero2", save_latest=False)
        return None

    def load(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(
            str(directory), tag="zero2", load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {directory}")


def build_strategy(model: nn.Module, cfg: TrainerConfig, env: DistEnv) -> Strategy:
    if cfg.strategy.type == "fsdp":
        return FsdpStrategy(model, cfg, env)
    return Zero2Strategy(model, cfg, env)
