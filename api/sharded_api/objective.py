"""The training objective of the trainer's configuration: next-token (sft) or preference (dpo) training."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sharded_api.rules import Model

__all__ = ["DpoConfig", "ObjectiveConfig", "reference_kind"]


class DpoConfig(Model):
    """Direct preference optimization: raise the policy's log-probability of the chosen answer over the
    rejected one, relative to a reference (the model as training starts)."""

    beta: float = Field(
        0.1, gt=0, le=100,
        description="Strength of the tie to the reference (the KL penalty's inverse temperature); for ipo, the "
        "regularization tau.",
    )  # fmt: skip
    loss: Literal["sigmoid", "ipo", "hinge"] = Field(
        "sigmoid",
        description="sigmoid: the DPO paper's loss; ipo: squared distance of the length-normalized log-ratio "
        "margin to 1/(2 beta); hinge: the SLiC hinge on the margin.",
    )
    # At most 0.49, not below 0.5: the API server compares an integer value (a defaulted 0.0 reaches it as 0)
    # with a fractional exclusive maximum as integers, and would refuse 0 as not less than int(0.5).
    label_smoothing: float = Field(
        0.0, ge=0, le=0.49,
        description="Loss sigmoid: the assumed probability that a pair's preference is flipped (conservative DPO).",
    )  # fmt: skip
    reference_free: bool = Field(
        False, description="Compare the policy's log-probabilities with no reference (a uniform one)."
    )
    reference: Literal["auto", "adapters", "precomputed", "copy"] = Field(
        "auto",
        description="Where the reference log-probabilities come from. adapters (LoRA): the same forward with the "
        "adapters turned off, no extra weights; precomputed: one pass over the records with the starting model "
        "before the first step, kept on the claim next to the checkpoints and reused by every restart; copy: a "
        "frozen copy of the starting model (without adapters) sharded like the policy, in the precision it "
        "computes in, with no gradients or optimizer state, run beside the policy at every step (no first pass, "
        "no files; its parameters cost memory). auto: adapters with LoRA, precomputed otherwise.",
    )


class ObjectiveConfig(Model):
    """What the model is trained to do with the records."""

    type: Literal["sft", "dpo"] = Field(
        "sft",
        description="sft: next-token loss (on the answers of chat records); dpo: preference training on records "
        "with `prompt` (a string, or chat `messages`) plus `chosen` and `rejected` answers.",
    )
    dpo: DpoConfig | None = Field(None, description="DPO's settings (type dpo; defaults when absent).")

    @property
    def dpo_settings(self) -> DpoConfig:
        return self.dpo or DpoConfig()


def reference_kind(dpo: DpoConfig, lora: bool) -> str:
    """free, adapters, precomputed or copy: what `reference` (auto) comes to, with or without LoRA."""
    if dpo.reference_free:
        return "free"
    if dpo.reference == "auto":
        return "adapters" if lora else "precomputed"
    return dpo.reference
