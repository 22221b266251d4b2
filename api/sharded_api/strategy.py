"""The one switch between FSDP2 and ZeRO-2 in the trainer's configuration, with each one's options."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sharded_api.rules import Model

__all__ = ["PURE_BF16", "FsdpOptions", "StrategyConfig", "Zero2Options", "fsdp_unsharded"]

# The precision that keeps no fp32 master (TrainerConfig's Literal spells it too: a type checker reads only
# literals).
PURE_BF16 = "bf16-pure"


def fsdp_unsharded(world: int, precision: str, cpu_offload: bool) -> bool:
    """Whether FSDP2 has nothing to do, so the trainer runs the model as it is: one process, whose parameters
    are stored in the dtype they compute in (fp32, or bf16-pure's bf16). Sharding over one process would only
    copy each block's weights into a gather buffer before its forward and again before its backward, and its
    gradients through a reduce buffer, with hooks around every block. Under bf16 or fp16 mixed precision that
    copy is the cast to the compute dtype, work the step needs anyway, and FSDP2 stays; so it does to offload."""
    return world == 1 and not cpu_offload and precision in ("fp32", PURE_BF16)


def _policy_field():  # one FieldInfo per model: pydantic keeps per-field state on it
    return Field(
    "full",
    description="What activationCheckpointing recomputes. full: each block's whole forward again in backward (the "
    "least memory: only the block's input is kept). selective: every matrix product's and attention's output is "
    "kept and only the element-wise work between them (norms, rotary, SiLU) is recomputed, so no matrix product "
    "runs twice, at the cost of those outputs' memory (the memory model counts it).",
    )  # fmt: skip


class _Checkpointing:
    activation_checkpointing: bool
    activation_checkpointing_policy: Literal["full", "selective"]

    @property
    def checkpointing(self) -> Literal["full", "selective"] | None:
        """The activation checkpointing each block gets, or None for none."""
        return self.activation_checkpointing_policy if self.activation_checkpointing else None


class FsdpOptions(_Checkpointing, Model):
    """PyTorch FSDP2 (`fully_shard`) options."""

    reshard_after_forward: bool = Field(
        True, description="Free gathered parameters after forward (ZeRO-3 memory); false keeps them (faster)."
    )
    cpu_offload: bool = Field(False, description="Keep parameters, gradients and optimizer state in CPU memory.")
    activation_checkpointing: bool = Field(False, description="Recompute each block's activations in backward.")
    activation_checkpointing_policy: Literal["full", "selective"] = _policy_field()
    compile: bool = Field(False, description="torch.compile each transformer block.")
    prefetch: int = Field(
        1, ge=0, le=4,
        description="Blocks whose all-gather each block issues ahead of its compute (forward: the next ones, "
        "backward: the previous ones). 0 leaves FSDP2's implicit order (backward one block ahead, forward as the "
        "host reaches each block); more overlaps more communication at the cost of memory for gathered blocks.",
    )  # fmt: skip
    reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="Dtype of the gradient reduce-scatter (and of the replicas' all-reduce under hybrid), at any "
        "precision: bf16 halves the bytes on the wire and rounds the summed gradients, fp32 keeps the sum exact. "
        "A run of one process sums nothing, and its gradients keep the dtype backward made them in.",
    )  # fmt: skip
    shard: Literal["full", "hybrid"] = Field(
        "full",
        description="full: shard over every process; hybrid: shard within each node and replicate across nodes "
        "(less traffic over the inter-node link, more memory per GPU). Checkpoints load under either.",
    )


class Zero2Options(_Checkpointing, Model):
    """DeepSpeed ZeRO stage 2 options."""

    overlap_comm: bool = Field(True, description="Overlap gradient reduction with backward.")
    contiguous_gradients: bool = Field(True, description="Copy gradients into one buffer to avoid fragmentation.")
    reduce_bucket_size: int = Field(500_000_000, ge=1_000_000, description="Elements per gradient reduce bucket.")
    allgather_bucket_size: int = Field(
        500_000_000, ge=1_000_000, description="Elements per parameter all-gather bucket."
    )
    cpu_offload_optimizer: bool = Field(False, description="Keep optimizer state on CPU (ZeRO-Offload).")
    activation_checkpointing: bool = Field(False, description="Recompute each block's activations in backward.")
    activation_checkpointing_policy: Literal["full", "selective"] = _policy_field()
    compile: bool = Field(False, description="torch.compile each transformer block.")


class StrategyConfig(Model):
    """The one switch between FSDP2 and ZeRO-2, with each one's options."""

    type: Literal["fsdp", "zero2", "auto"] = Field(
        "fsdp",
        description="fsdp (PyTorch FSDP2), zero2 (DeepSpeed ZeRO-2), or auto: at start the trainer picks the fastest "
        "setting (strategy, resharding, activation checkpointing, offload) that its memory model says fits in 90% "
        "of the GPU (`python -m sharded_trainer plan`), keeps the strategy of the job's newest checkpoint, and "
        "says why in an event; the chosen section's other options (compile, prefetch, buckets) apply.",
    )  # fmt: skip
    fsdp: FsdpOptions = Field(default_factory=FsdpOptions, description="Used when type is fsdp.")
    zero2: Zero2Options = Field(default_factory=Zero2Options, description="Used when type is zero2.")
