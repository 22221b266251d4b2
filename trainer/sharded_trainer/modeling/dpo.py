"""Direct preference optimization's maths: sequence log-probabilities and the pairwise losses, in fp32.

A micro-batch of B pairs is 2B rows, the B chosen answers' rows then the B rejected ones', through one
forward pass. Log-probabilities are summed over the answer's tokens (targets other than IGNORE). The losses
follow the papers and TRL's DPOTrainer (the test oracle): with the log-ratios
`c = logp(chosen) - ref(chosen)`, `r = logp(rejected) - ref(rejected)` and `d = c - r`,

- sigmoid (DPO): `-(1 - e) log s(beta d) - e log s(-beta d)`, with e the label smoothing (conservative DPO);
- ipo: `(d' - 1 / (2 beta))^2`, d' from log-ratios averaged over each answer's tokens (IPO's authors'
  normalization, as TRL does);
- hinge (SLiC): `relu(1 - beta d)`;

and the rewards `beta c`, `beta r` whose order on a pair is the reward accuracy.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from sharded_trainer.data.sources import IGNORE


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the target tokens' log-probabilities per row, in fp32; answer tokens per row)."""
    keep = targets != IGNORE
    log_probs = F.log_softmax(logits, dim=-1, dtype=torch.float32)
    picked = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * keep).sum(-1), keep.sum(-1)


class PairLoss(NamedTuple):
    """Per pair: the loss and both rewards (the rewards carry no gradient)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def pair_loss(
    policy: torch.Tensor, reference: torch.Tensor, lengths: torch.Tensor, *, beta: float, loss: str,
    label_smoothing: float = 0.0,
) -> PairLoss:  # fmt: skip
    """DPO's loss of B pairs from (2B,) sequence log-probabilities of the policy and of the reference (zeros:
    reference-free) and the (2B,) answer lengths, chosen rows first."""
    logratios = policy - reference
    chosen, rejected = logratios.chunk(2)
    if loss == "sigmoid":
        d = beta * (chosen - rejected)
        losses = -(1 - label_smoothing) * F.logsigmoid(d) - label_smoothing * F.logsigmoid(-d)
    elif loss == "ipo":
        n_chosen, n_rejected = lengths.to(policy.dtype).clamp(min=1).chunk(2)
        losses = (chosen / n_chosen - rejected / n_rejected - 1 / (2 * beta)) ** 2
    elif loss == "hinge":
        losses = torch.relu(1 - beta * (chosen - rejected))
    else:
        raise ValueError(f"objective.dpo.loss {loss!r}: use sigmoid, ipo or hinge")
    return PairLoss(losses, beta * chosen.detach(), beta * rejected.detach())


def pair_rows(inputs: torch.Tensor) -> torch.Tensor:
    """(B, 2, L) pairs as collated -> (2B, L) rows: the B chosen rows, then the B rejected ones."""
    return inputs.transpose(0, 1).flatten(0, 1)
