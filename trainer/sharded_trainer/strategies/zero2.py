"""DeepSpeed ZeRO stage 2 applied to an unchanged model; checkpoints in DeepSpeed's own format, which
this module also reloads at another world size (DeepSpeed itself refuses to)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from sharded_api.config import TrainerConfig
from sharded_api.strategy import Zero2Options
from sharded_trainer.modeling.decoder import Network
from sharded_trainer.modeling.quantize import quantize_base
from sharded_trainer.objective import build_objective
from sharded_trainer.process_group import DistEnv
from sharded_trainer.strategies.optim import adamw_kwargs, make_optimizer, make_scheduler
from sharded_trainer.strategies.parallel import (
    Batch,
    decoder_layers,
    held_out_loss,
    materialize,
    to_device,
    trainable,
    wrap_blocks,
)

# DeepSpeed writes a checkpoint into <step directory>/<tag>/; its partitioned optimizer state is laid
# out there in files only DeepSpeed reads back.
TAG = "zero2"
# One file per data-parallel rank: that rank's partition of the fp32 master weights and optimizer state.
PARTITION_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")


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


def apply_zero2(net: Network, *, cfg: TrainerConfig, device: torch.device):
    """Wrap the model in a DeepSpeed engine with ZeRO-2 (sharded gradients and optimizer state)."""
    import deepspeed

    options, model = cfg.strategy.zero2, net.module
    wrap_blocks(decoder_layers(model), checkpointing=options.checkpointing, compile=options.compile)
    if net.source is not None:
        # ZeRO-2 keeps every parameter on every rank: read each once, in the dtype it is kept in, straight
        # into its place on the device (no full fp32 copy in host memory).
        materialize(model, device, net.source)
    else:
        model.to(device)
    if options.cpu_offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(trainable(model), **adamw_kwargs(cfg.optimizer))
    else:
        optimizer = make_optimizer(trainable(model), cfg, device)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=make_scheduler(optimizer, cfg),
        config=zero2_config(cfg, options), dist_init_required=False,
    )  # fmt: skip
    return engine


class Zero2Strategy:
    """ZeRO-2 training step; a checkpoint is DeepSpeed's files under the step directory's `TAG` folder."""

    def __init__(self, net: Network, cfg: TrainerConfig, env: DistEnv):
        import deepspeed

        deepspeed.init_distributed(dist_backend=env.backend, auto_mpi_discovery=False)
        self.env, self.cfg, self.net = env, cfg, net
        self.layout = f"optimizer state and gradients in {env.world} partitions"
        self.engine = apply_zero2(net, cfg=cfg, device=env.device)
        self.model = self.engine.module
        if net.adapter_only:
            self._save_adapters_only()
        if cfg.lora is not None and cfg.lora.quantize_base == "nf4":
            # After DeepSpeed has cast the module (a cast of an NF4 tensor dequantizes it): ZeRO-2 keeps the
            # whole base on every rank, so each weight is quantized whole, in place, and its bf16 form freed.
            quantized = quantize_base(decoder_layers(self.model), shards=1, compiled=cfg.strategy.zero2.compile)
            self.layout += f", {len(quantized)} NF4 base weights"
            # The engine and its ZeRO optimizer name parameters in a dict keyed by them, which would keep every
            # bf16 weight alive.
            names = {p: n for n, p in self.model.named_parameters()}
            for holder in (self.engine, self.engine.optimizer):
                if hasattr(holder, "param_names"):
                    holder.param_names = names
        self.objective = build_objective(net, cfg, env.device, cfg.strategy.zero2.compile, self._place_copy)

    def _place_copy(self, net: Network) -> nn.Module:
        """DPO's frozen reference whole on every rank, as ZeRO-2 keeps the policy's parameters (outside the engine:
        it has no gradients or optimizer state)."""
        wrap_blocks(decoder_layers(net.module), checkpointing=None, compile=self.cfg.strategy.zero2.compile)
        if net.source is not None:
            materialize(net.module, self.env.device, net.source)
        else:
            net.module.to(self.env.device)
        return net.module

    def train_step(self, micro_batches: Sequence[Batch]) -> tuple[torch.Tensor, torch.Tensor | None]:
        total = torch.zeros((), device=self.env.device)
        for batch in micro_batches:
            loss = self.objective.loss(self.engine, to_device(batch, self.env.device))
            self.engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
            self.engine.step()  # steps optimizer and scheduler only at the accumulation boundary
            total += loss.detach()
        norm = self.engine.get_global_grad_norm()
        return total / len(micro_batches), None if norm is None else torch.as_tensor(norm)

    def _save_adapters_only(self) -> None:
        """DeepSpeed's exclude_frozen_parameters drops frozen parameters by their first name only: a tied
        output head (the frozen embedding under a second name) would still be saved. Drop every name of
        every frozen parameter, as the state dict names it (without the activation-checkpointing wrapper's
        prefix, which its state-dict hook strips)."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

        frozen = {n.replace(_CHECKPOINT_PREFIX, "") for n, p in self.model.named_parameters(remove_duplicate=False)
                  if not p.requires_grad}  # fmt: skip
        module_state_dict = self.engine.module_state_dict

        def adapters_only(*args, **kwargs):
            state = module_state_dict(*args, **kwargs)
            for name in frozen & set(state):
                del state[name]
            return state

        self.engine.module_state_dict = adapters_only

    @property
    def forward_module(self):
        """What a forward pass goes through: DeepSpeed's engine (it gathers nothing under ZeRO-2, but owns the
        hooks that cast and reduce)."""
        return self.engine

    def eval_loss(self, batch: Batch) -> dict[str, float]:
        return held_out_loss(self.objective, self.engine, batch, self.env.device)

    def current_lr(self) -> float:
        return self.engine.get_lr()[0]

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far because fp16 gradients overflowed (dynamic loss scaling)."""
        return int(getattr(self.engine, "skipped_steps", 0))

    def save(self, directory: Path, *, async_save: bool) -> object | None:
        # DeepSpeed's own format: it knows how its partitioned optimizer state is laid out.
        # A LoRA run saves its adapters only: the frozen base is the model directory.
        self.engine.save_checkpoint(
            str(directory), tag=TAG, save_latest=False, exclude_frozen_parameters=self.net.adapter_only
        )
        return None

    def load(self, directory: Path) -> None:
        saved_world = len(partition_files(directory))
        same_world = saved_world == self.env.world
        # At another world size DeepSpeed loads the module, scheduler and counters; the partitions follow.
        path, _ = self.engine.load_checkpoint(
            str(directory), tag=TAG, load_optimizer_states=same_world, load_lr_scheduler_states=True,
            load_module_strict=not self.net.adapter_only,
        )  # fmt: skip
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {directory}")
        if not same_world:
            repartition(self.engine.optimizer, partition_files(directory), self.env.rank, self.env.world)
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


def partition_files(directory: Path) -> list[Path]:
    """The saving world's optimizer partitions, in rank order (checked to be 0..n-1 with none missing)."""
    files = (directory / TAG).glob("*optim_states.pt")
    found = {int(m[1]): f for f in files if (m := PARTITION_FILE.fullmatch(f.name))}
    if sorted(found) != list(range(len(found))) or not found:
        raise FileNotFoundError(f"{directory / TAG}: optimizer partitions {sorted(found)} are not ranks 0..n-1")
    return [found[r] for r in range(len(found))]


def window(pieces: Sequence[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of the concatenation of `pieces`, copying only those (the pieces may be mmapped)."""
    out, offset = [], 0
    for piece in pieces:
        flat = piece.reshape(-1)
        a, b = max(lo, offset), min(hi, offset + flat.numel())
        if a < b:
            out.append(flat[a - offset : b - offset])
        offset += flat.numel()
    return torch.cat(out) if out else pieces[0].new_empty(0)


def _partition(pieces: Sequence[torch.Tensor], span: tuple[int, int], size: int, device) -> torch.Tensor:
    """A partition of `size` elements holding elements span of the concatenated pieces, zero-padded."""
    lo, hi = span
    out = torch.zeros(size, dtype=pieces[0].dtype, device=device)
    if hi > lo:
        out[: hi - lo] = window(pieces, lo, hi)
    return out


def _unpadded_group_state(saved: dict, group: int) -> dict:
    """One saved rank's optimizer state for a parameter group, its partition tensors without the padding
    DeepSpeed adds to the last rank (the base optimizer's own state_dict, as DeepSpeed saves by default)."""
    from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, SINGLE_PARTITION_OF_FP32_GROUPS

    base = saved[BASE_OPTIMIZER_STATE]
    lean = saved[SINGLE_PARTITION_OF_FP32_GROUPS][group].numel()
    state = base["state"].get(base["param_groups"][group]["params"][0], {})
    return {k: v.reshape(-1)[:lean] if torch.is_tensor(v) and v.dim() > 0 else v for k, v in state.items()}


def repartition(optimizer, files: Sequence[Path], rank: int, world: int) -> None:
    """Load ZeRO-1/2 partitions written by a world of `len(files)` ranks into `optimizer` (a DeepSpeed ZeRO
    optimizer built for `world` ranks): fp32 master weights and every per-element optimizer state, exact.

    A group's partitions, without their padding, concatenate to the group's flat buffer in both worlds
    (padding only ever follows the last element), so this rank's new partition is a window of the saved
    ones. Files are memory-mapped: a rank reads only the bytes of its own window."""
    from deepspeed.checkpoint.constants import (
        BASE_OPTIMIZER_STATE,
        OPTIMIZER_STATE_DICT,
        PARAM_ALIGNMENT_PADDINGS,
        SINGLE_PARTITION_OF_FP32_GROUPS,
    )

    saved = [torch.load(f, map_location="cpu", mmap=True, weights_only=False)[OPTIMIZER_STATE_DICT] for f in files]
    if not all(isinstance(sd[BASE_OPTIMIZER_STATE], dict) for sd in saved):
        raise RuntimeError("ZeRO partitions saved with zero_optimization.elastic_checkpoint cannot change world size")
    aligned = [any(p) for sd in saved for p in sd.get(PARAM_ALIGNMENT_PADDINGS) or []]
    if any(aligned) or any(any(p) for p in getattr(optimizer, "round_robin_bit16_padding", [])):
        raise RuntimeError("ZeRO partitions with per-parameter alignment padding cannot change world size")
    optimizer._load_global_state(saved[0])  # loss scaler, overflow flag, clip setting: the same on every rank
    inner = optimizer.optimizer
    for g, fp32 in enumerate(optimizer.single_partition_of_fp32_groups):
        pieces = [sd[SINGLE_PARTITION_OF_FP32_GROUPS][g] for sd in saved]
        total = sum(p.numel() for p in pieces)
        expected = sum(p.numel() for p in optimizer.bit16_groups[g])
        if total != expected:
            raise RuntimeError(f"parameter group {g}: the checkpoint holds {total} elements, the model {expected}")
        size = fp32.numel()  # every rank's partition has this size; the last one ends in padding
        span = (rank * size, min((rank + 1) * size, total))
        fp32.data.copy_(_partition(pieces, span, size, fp32.device))
        states = [_unpadded_group_state(sd, g) for sd in saved]
        param = inner.param_groups[g]["params"][0]
        # The hyperparameters as saved: the learning rate is the one the scheduler set for the next step.
        hyper = saved[0][BASE_OPTIMIZER_STATE]["param_groups"][g]
        inner.param_groups[g].update({k: v for k, v in hyper.items() if k != "params"})
        inner.state[param] = {
            key: _partition([s[key] for s in states], span, size, param.device)
            if torch.is_tensor(value) and value.dim() > 0
            else (value.clone() if torch.is_tensor(value) else value)  # the step count: the same on every rank
            for key, value in states[0].items()
        }  # fmt: skip
    if hasattr(optimizer, "_link_all_hp_params"):
        optimizer._link_all_hp_params()
