"""PyTorch FSDP2 (`fully_shard`) applied to an unchanged model; checkpoints through torch.distributed.checkpoint."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from sharded_api.config import TrainerConfig
from sharded_api.strategy import FsdpOptions, fsdp_unsharded
from sharded_trainer.modeling.decoder import Network, cast_parameters
from sharded_trainer.modeling.quantize import quantize_base
from sharded_trainer.objective import build_objective
from sharded_trainer.process_group import DistEnv
from sharded_trainer.strategies.optim import make_optimizer, make_scheduler
from sharded_trainer.strategies.parallel import (
    DTYPES,
    Batch,
    decoder_layers,
    held_out_loss,
    materialize,
    to_device,
    trainable,
    wrap_blocks,
)


def apply_fsdp(
    model: nn.Module,
    *,
    mesh,
    options: FsdpOptions,
    param_dtype: torch.dtype,
    ignored: set[nn.Parameter] | None = None,
    frozen: bool = False,
) -> nn.Module:
    """Shard each transformer block, then the root (embeddings, final norm, output) with FSDP2.

    Blocks are sharded first so each one all-gathers and frees its own parameters around its compute;
    the root call then picks up whatever parameters no block owns (the tied embedding among them).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    # An fp32 run computes in its stored dtype (no cast), yet may still reduce gradients in bf16. One process
    # has nothing to sum: FSDP2 still copies each block's gradients through a buffer of the reduce dtype, so
    # there they stay in the dtype backward made them in (the same numbers; under bf16-pure 8 bytes of traffic
    # per parameter instead of 20).
    compute = None if param_dtype == torch.float32 else param_dtype
    world = mesh.size() if mesh is not None else torch.distributed.get_world_size()  # None: FSDP2's default mesh
    reduce = DTYPES[options.reduce_dtype] if world > 1 else None
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce)
    # Pinned host memory needs a GPU; on a CPU-only run the offload has nowhere to move anything.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    extra = {"offload_policy": offload} if options.cpu_offload else {}
    if ignored:
        extra["ignored_params"] = ignored
    sharded = wrap_blocks(decoder_layers(model), checkpointing=options.checkpointing, compile=options.compile)
    for block in sharded:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=options.reshard_after_forward, **extra)
    # The root's parameters are needed again at the start of backward: keep them gathered. A frozen module
    # (DPO's reference copy) has no backward to free them: every forward reshards.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=frozen, **extra)
    # prefetch N: each block issues the all-gathers of the next N blocks before its own forward compute and
    # of the previous N before its backward. 0 leaves FSDP2's implicit order: forward all-gathers issued as
    # the host reaches each block, backward one block ahead.
    if options.prefetch >= 1:
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
    """FSDP2 training step; a checkpoint is DCP's sharded files (`model`, `optim`, `scheduler` keys)."""

    def __init__(self, net: Network, cfg: TrainerConfig, env: DistEnv):
        from torch.distributed.device_mesh import init_device_mesh

        self.env, self.cfg, self.net = env, cfg, net
        if cfg.strategy.fsdp.shard == "hybrid":  # HSDP: rows are nodes (replicas), columns a node's processes
            per_node = env.local_world
            if env.world % per_node:
                raise ValueError(f"strategy.fsdp.shard hybrid needs the same processes on every node: {env.world} "
                                 f"processes, {per_node} on this node")  # fmt: skip
            shape, names = (env.world // per_node, per_node), ("replicate", "shard")
            self.layout = f"hybrid: {shape[0]} replicas x {shape[1]} shards"
        else:
            shape, names = (env.world,), ("shard",)
            self.layout = f"full: {env.world} shards"
        self.layout += f", prefetch {cfg.strategy.fsdp.prefetch}"
        self.mesh = init_device_mesh(env.device.type, shape, mesh_dim_names=names)
        ignored = None
        if cfg.lora is not None and cfg.lora.quantize_base == "nf4":  # before sharding: FSDP2 shards the 4-bit form
            quantized = quantize_base(decoder_layers(net.module), shards=env.world, compiled=cfg.strategy.fsdp.compile)
            self.layout += f", {len(quantized)} NF4 base weights"
            # One process has nothing to gather, and FSDP2's path for a world of one (torch 2.11) hands a
            # tensor subclass one all-gather output where NF4 has three: the weights stay outside it.
            ignored = set(quantized) if env.world == 1 else None
        if cfg.pure_bf16:  # no fp32 master: the sharded parameters themselves are bf16
            cast_parameters(net.module, torch.bfloat16)
        self.unsharded = fsdp_unsharded(env.world, cfg.precision, cfg.strategy.fsdp.cpu_offload)
        if self.unsharded:
            self.layout = f"unsharded: 1 process, {cfg.precision} parameters (nothing to shard or cast)"
        self.model = self._place(net, cfg.strategy.fsdp, ignored=ignored)
        self.objective = build_objective(net, cfg, env.device, cfg.strategy.fsdp.compile, self._place_copy)
        self.optimizer = make_optimizer(trainable(self.model), cfg, env.device)
        self.scheduler = make_scheduler(self.optimizer, cfg)
        self._ckpt_group = None
        self._stager = None

    def _place_copy(self, net: Network) -> nn.Module:
        """DPO's frozen reference sharded as the policy is, with nothing kept gathered between its forwards (it
        has no backward) and no activations kept for one."""
        options = self.cfg.strategy.fsdp.model_copy(update={"activation_checkpointing": False,
                                                            "reshard_after_forward": True})  # fmt: skip
        return self._place(net, options, frozen=True)

    def _place(self, net: Network, options: FsdpOptions, *, ignored=None, frozen: bool = False) -> nn.Module:
        """`net`'s module sharded (or, where FSDP2 has nothing to do, as it is) and on its device, its weights
        read from the source it was built from."""
        if self.unsharded:
            module = net.module
            wrap_blocks(decoder_layers(module), checkpointing=options.checkpointing,
                        compile=options.compile)  # fmt: skip
            if net.source is None:
                module.to(self.env.device)
        else:
            module = apply_fsdp(net.module, mesh=self.mesh, options=options, param_dtype=DTYPES[self.cfg.precision],
                                ignored=ignored, frozen=frozen)  # fmt: skip
        if net.source is not None:  # built on the meta device: each rank reads only the rows it keeps
            # FSDP2 keeps offloaded shards in host memory and moves each to the GPU as it is used.
            materialize(module, torch.device("cpu") if options.cpu_offload else self.env.device, net.source)
        return module

    def train_step(self, micro_batches: Sequence[Batch]) -> tuple[torch.Tensor, torch.Tensor | None]:
        total = torch.zeros((), device=self.env.device)
        for batch in micro_batches:
            loss = self.objective.loss(self.model, to_device(batch, self.env.device))
            (loss / len(micro_batches)).backward()
            total += loss.detach()
        norm = None
        if self.cfg.grad_clip_norm > 0:  # the norm is a pass over every gradient plus an all-reduce
            norm = torch.nn.utils.clip_grad_norm_(trainable(self.model), self.cfg.grad_clip_norm)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if self.cfg.pure_bf16:
            # The stochastic rounding draws from the generator seeded by (seed, step, rank), on the side of the
            # global one: a resumed run rounds as the uninterrupted run did.
            step = self.scheduler.last_epoch
            with torch.random.fork_rng(devices=[self.env.device] if self.env.device.type == "cuda" else []):
                torch.manual_seed(hash((self.cfg.seed, step, self.env.rank)) & (2**63 - 1))
                self.optimizer.step()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return total / len(micro_batches), norm

    @property
    def forward_module(self) -> nn.Module:
        """What a forward pass goes through (the objective's, the reference pass's)."""
        return self.model

    def eval_loss(self, batch: Batch) -> dict[str, float]:
        return held_out_loss(self.objective, self.model, batch, self.env.device)

    def current_lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])  # torchao's AdamW keeps the rate as a tensor

    def _options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # A LoRA run saves its adapters and their optimizer state only: the frozen base is the model directory.
        return StateDictOptions(ignore_frozen_params=self.net.adapter_only, strict=not self.net.adapter_only)

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
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
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
            options=self._options(),
        )  # fmt: skip
        self.scheduler.load_state_dict(state["scheduler"])

    @staticmethod
    def rank_files(rank: int) -> str:
        return f"__{rank}_*.distcp"  # DCP's file system writer: one prefix per rank; `.metadata` is rank 0's

    @staticmethod
    def weights_source(directory: Path) -> str:
        # FSDP2 keeps the sharded parameters in fp32 and casts a copy for compute (MixedPrecisionPolicy);
        # under bf16-pure the parameters themselves are bf16.
        import torch.distributed.checkpoint as dcp

        meta = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
        dtypes = {
            getattr(getattr(m, "properties", None), "dtype", None) for k, m in meta.items() if k.startswith("model.")
        }
        return "bf16 sharded parameters" if torch.bfloat16 in dtypes else "fp32 sharded parameters"

    @classmethod
    def full_model_state(cls, model: nn.Module, directory: Path) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp

        keys = set(dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata)
        # Only the keys the checkpoint has: a LoRA run saved its adapters, not the frozen base.
        state = {"model": {k: v for k, v in model.state_dict().items() if f"model.{k}" in keys}}
        dcp.load(state, checkpoint_id=str(directory), no_dist=True)  # reads only the model's keys
        return state["model"]
