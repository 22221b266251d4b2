"""DeepSpeed ZeRO stage 2 applied to an unchanged model; checkpoints in DeepSpeed's own format."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from sharded_trainer.config import TrainerConfig, Zero2Options
from sharded_trainer.loss import loss_function
from sharded_trainer.optim import adamw_kwargs, make_optimizer, make_scheduler
from sharded_trainer.parallel import Batch, to_device, wrap_blocks
from sharded_trainer.process_group import DistEnv

# DeepSpeed writes a checkpoint into <step directory>/<tag>/; its partitioned optimizer state is laid
# out there in files only DeepSpeed reads back.
TAG = "zero2"


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

        optimizer = DeepSpeedCPUAdam(model.parameters(), **adamw_kwargs(cfg.optimizer))
    else:
        optimizer = make_optimizer(model.parameters(), cfg, device)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=make_scheduler(optimizer, cfg),
        config=zero2_config(cfg, options), dist_init_required=False,
    )  # fmt: skip
    return engine


class Zero2Strategy:
    """ZeRO-2 training step; a checkpoint is DeepSpeed's files under the step directory's `TAG` folder."""

    world_bound = True  # the optimizer state is partitioned for the world that saved it

    def __init__(self, model: nn.Module, cfg: TrainerConfig, env: DistEnv):
        import deepspeed

        deepspeed.init_distributed(dist_backend=env.backend, auto_mpi_discovery=False)
        self.env, self.cfg = env, cfg
        self.layout = f"optimizer state and gradients in {env.world} partitions"
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

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far because fp16 gradients overflowed (dynamic loss scaling)."""
        return int(getattr(self.engine, "skipped_steps", 0))

    def save(self, directory: Path, *, async_save: bool) -> object | None:
        # DeepSpeed's own format: it knows how its partitioned optimizer state is laid out.
        self.engine.save_checkpoint(str(directory), tag=TAG, save_latest=False)
        return None

    def load(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(
            str(directory), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {directory}")
        if self.cfg.strategy.zero2.cpu_offload_optimizer:
            # A checkpoint written with torch's AdamW (offload switched on since): its parameter groups lack
            # the key DeepSpeed's CPU Adam reads; the moments and the step carry over as they are.
            inner = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
            for group in inner.param_groups:
                group.setdefault("bias_correction", True)

    @staticmethod
    def rank_files(rank: int) -> str:
        return f"{TAG}/*zero_pp_rank_{rank}_*"  # each rank's optimizer partition; the model states are rank 0's

    @classmethod
    def full_model_state(cls, model: nn.Module, directory: Path) -> dict[str, torch.Tensor]:
        # ZeRO-2 does not partition parameters: rank 0's model-states file holds every module weight, in the
        # training dtype. A bf16 or fp16 run's weights there are rounded; its fp32 master copy is partitioned
        # with the optimizer state, and DeepSpeed's own consolidation reassembles it.
        files = sorted((directory / TAG).glob("mp_rank_00_model_states.pt"))
        if not files:
            raise FileNotFoundError(f"no DeepSpeed model states under {directory / TAG}")
        module = torch.load(files[0], map_location="cpu", weights_only=False)["module"]
        state = {k: v.float() for k, v in module.items()}
        if any(v.is_floating_point() and v.dtype != torch.float32 for v in module.values()):
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            master = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=TAG)
            state.update({k: v.float() for k, v in master.items() if k in state})
        return state

    @staticmethod
    def weights_source(directory: Path) -> str:
        files = sorted((directory / TAG).glob("mp_rank_00_model_states.pt"))
        module = torch.load(files[0], map_location="cpu", weights_only=False)["module"] if files else {}
        rounded = any(v.is_floating_point() and v.dtype != torch.float32 for v in module.values())
        return "fp32 master weights from the optimizer partitions" if rounded else "fp32 module weights"
