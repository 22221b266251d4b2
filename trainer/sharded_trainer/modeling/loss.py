"""The training loss: token cross-entropy in fp32 from low-precision logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sharded_trainer.data.sources import IGNORE


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy computed in fp32 from low-precision logits.

    The same values as upcasting the logits first (bf16 -> fp32 is exact), written so that compiling it
    pays off: eager, `log_softmax(..., dtype=float32)` still makes an fp32 copy of bf16 logits (ATen
    fuses the cast only for fp16), but the compiled graph reads the bf16 logits and writes their bf16
    gradient without any fp32 tensor of the logits' size, 1 GiB per 2048-token sequence at a 128k
    vocabulary.
    """
    log_probs = F.log_softmax(logits.flatten(0, 1), dim=-1, dtype=torch.float32)
    targets = targets.flatten(0, 1)
    # Mean over the tokens that carry a loss (targets of -100 do not: padding, prompts), 0 when none does:
    # a micro-batch of prompts alone must not turn the step's loss into NaN.
    total = F.nll_loss(log_probs, targets, ignore_index=IGNORE, reduction="sum")
    return total / (targets != IGNORE).sum().clamp(min=1)


def loss_function(compile: bool):
    """The cross-entropy, compiled when the blocks are: the log-softmax, loss and backward then fuse
    into two kernels that read the bf16 logits and write their bf16 gradient."""
    return torch.compile(cross_entropy, fullgraph=True) if compile else cross_entropy
