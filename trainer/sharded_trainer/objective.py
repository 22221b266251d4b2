"""What a micro-batch's loss is: next-token cross-entropy (sft) or preference (dpo). The strategies call
`loss` inside their step and `held_out` when evaluating; the objective keeps the metrics of its own kind.

DPO's reference log-probabilities come from one of four places:
- adapters (LoRA): the same model with the adapters turned off, in a forward without gradients after the
  policy's; no extra weights;
- copy: a frozen copy of the starting model, without adapters, built again from the same weights and placed by
  the strategy as the policy is (sharded by FSDP2, whole under ZeRO-2) in the dtype it computes in: no fp32
  master, gradients or optimizer state, and nothing on the claim; its forward runs after the policy's;
- precomputed: one pass over every record with the starting model before the first step (under LoRA, the base:
  the starting adapters add zeros), written to the claim next to the checkpoints in parts as it goes, so a restart
  reuses them and an interrupted pass goes on from its last part; each pair then carries its two numbers;
- none (referenceFree).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from sharded_api.config import TrainerConfig
from sharded_api.objective import reference_kind as objective_reference
from sharded_trainer.data.sources import IGNORE, Batch, PairBatch, collate
from sharded_trainer.modeling.decoder import DTYPES, Network, cast_parameters
from sharded_trainer.modeling.dpo import pair_loss, pair_rows, sequence_logps
from sharded_trainer.modeling.loss import loss_function

# Records per part of a precomputed reference: a restart loses at most one part's forward passes. A fixed
# count, so that a pass resumed on another world size adds to the same parts.
PART_RECORDS = 512
# The DPO metrics, in the order the objective sums them (over pairs).
DPO_METRICS = ("reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward")


class NextToken:
    """Token cross-entropy over the targets (compiled when the blocks are)."""

    kind = "sft"

    def __init__(self, net: Network, compile: bool):
        self.net, self.fn = net, loss_function(compile)

    def loss(self, module, batch: Batch) -> torch.Tensor:
        return self.fn(self.net.logits(module, batch.inputs, batch.positions), batch.targets)

    def held_out(self, module, batch: Batch) -> dict[str, float]:
        """Sums over one held-out micro-batch: the loss weighted by its tokens, and the tokens."""
        tokens = int((batch.targets != IGNORE).sum())
        return {"loss": float(self.loss(module, batch)) * tokens, "weight": tokens}

    def flush(self, world: int) -> dict[str, float]:
        return {}


class Preference:
    """DPO on pairs: each micro-batch's B pairs in one forward pass of 2B rows."""

    kind = "dpo"

    def __init__(self, net: Network, cfg: TrainerConfig, device: torch.device, place=None):
        self.net, self.settings = net, cfg.objective.dpo_settings
        self.reference = reference_kind(cfg)
        self.sums = torch.zeros(1 + len(DPO_METRICS), dtype=torch.float64, device=device)
        self.copy = frozen_copy(cfg, place) if self.reference == "copy" else None

    def _policy_logps(self, module, rows: torch.Tensor, targets: torch.Tensor):
        return sequence_logps(self.net.logits(module, rows, None), targets)

    def reference_logps(self, module, rows: torch.Tensor, targets: torch.Tensor, batch: PairBatch) -> torch.Tensor:
        if self.reference == "free":
            return torch.zeros(rows.shape[0], device=rows.device)
        if self.reference == "precomputed":
            assert batch.reference is not None, "the reference log-probabilities were not loaded"
            return pair_rows(batch.reference.to(torch.float32).unsqueeze(-1)).squeeze(-1)
        if self.reference == "copy":
            net, copy = self.copy
            with torch.no_grad():
                return sequence_logps(net.logits(copy, rows, None), targets)[0]
        with torch.no_grad(), adapters_off(self.net):
            return self._policy_logps(module, rows, targets)[0]

    def _pairs(self, module, batch: PairBatch):
        rows, targets = pair_rows(batch.inputs), pair_rows(batch.targets)
        # The policy's forward first: FSDP2 sets its gradient dtypes up at a module's first forward from the
        # parameters that require gradients, which peft's disable_adapter turns off for the adapters.
        policy, lengths = self._policy_logps(module, rows, targets)
        reference = self.reference_logps(module, rows, targets, batch)
        s = self.settings
        return pair_loss(policy, reference, lengths, beta=s.beta, loss=s.loss, label_smoothing=s.label_smoothing)

    @staticmethod
    def _stats(out) -> torch.Tensor:
        margin = out.chosen_rewards - out.rejected_rewards
        per_pair = torch.stack([(margin > 0).double(), margin.double(), out.chosen_rewards.double(),
                                out.rejected_rewards.double()])  # fmt: skip
        return torch.cat([torch.ones(1, dtype=torch.float64, device=margin.device) * margin.numel(),
                          per_pair.sum(-1)])  # fmt: skip

    def loss(self, module, batch: PairBatch) -> torch.Tensor:
        out = self._pairs(module, batch)
        self.sums += self._stats(out)
        return out.losses.mean()

    def held_out(self, module, batch: PairBatch) -> dict[str, float]:
        """Sums over the pairs of one held-out micro-batch that carry answers (a rank past the end runs pairs
        whose targets are all IGNORE: they count for nothing)."""
        real = (pair_rows(batch.targets) != IGNORE).any(-1).chunk(2)[0]
        out = self._pairs(module, batch)
        stats = self._stats(out._replace(losses=out.losses[real], chosen_rewards=out.chosen_rewards[real],
                                         rejected_rewards=out.rejected_rewards[real]))  # fmt: skip
        sums = {"loss": float(out.losses[real].sum()), "weight": int(real.sum())}
        return {**sums, **{f"eval_{k}": float(v) for k, v in zip(DPO_METRICS, stats[1:].tolist(), strict=True)}}

    def flush(self, world: int) -> dict[str, float]:
        """The metrics' means over every pair of every rank since the last flush (synchronizes)."""
        sums = self.sums.clone()
        if world > 1:
            dist.all_reduce(sums)
        self.sums.zero_()
        pairs = max(float(sums[0]), 1.0)
        return {k: round(float(v) / pairs, 5) for k, v in zip(DPO_METRICS, sums[1:].tolist(), strict=True)}


def build_objective(net: Network, cfg: TrainerConfig, device: torch.device, compile: bool, place=None):
    """The objective of `cfg`; `place(net) -> module` puts a frozen reference copy where the strategy keeps the
    policy (called only for objective.dpo.reference copy)."""
    if cfg.objective.type == "dpo":
        return Preference(net, cfg, device, place)
    return NextToken(net, compile)


def frozen_copy(cfg: TrainerConfig, place) -> tuple[Network, torch.nn.Module]:
    """The starting model built again without adapters, frozen, its parameters cast to the dtype it computes in
    (mixed precision computes in the cast of the fp32 master: the same numbers), then placed by the strategy.
    Buffers keep their dtype, as mixed precision leaves the policy's: a RoPE table in bf16 turns the angles
    of late positions (measured on the 8B shape at seq 2048: rewards off by 0.7 at the first step)."""
    from sharded_trainer.modeling.build import build_network

    net = build_network(cfg.model_copy(update={"lora": None}))
    net.module.requires_grad_(False)
    cast_parameters(net.module, DTYPES[cfg.precision])
    module = place(net)
    module.eval()
    return net, module


def reference_kind(cfg: TrainerConfig) -> str:
    """free, adapters, precomputed or copy: what objective.dpo.reference (auto) comes to for this config."""
    return objective_reference(cfg.objective.dpo_settings, cfg.lora is not None)


@contextlib.contextmanager
def adapters_off(net: Network):
    """The frozen base alone: peft's adapters turned off for the forward passes inside (nothing without them)."""
    disable = getattr(net.module, "disable_adapter", None)
    if disable is None:
        yield
        return
    with disable():
        yield


def reference_key(cfg: TrainerConfig, net: Network, cache: Path) -> str:
    """What precomputed reference log-probabilities depend on: the tokenized records, the starting model (its
    shape and directory; not the adapters, which are off), the sequence length (truncation) and precision."""
    model = {k: v for k, v in net.fingerprint.items() if k != "lora"}
    parts = {"records": cache.name, "model": model, "path": cfg.model.huggingface and cfg.model.huggingface.path,
             "seqLen": cfg.seq_len, "precision": cfg.precision}  # fmt: skip
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _write_aside(path: Path, array: np.ndarray) -> None:
    aside = path.with_name(f"{path.name}.writing-{os.getpid()}.npy")
    np.save(aside, array)
    os.replace(aside, path)


def sound_reference_files(directory: Path, total: int) -> tuple[list[str], list[tuple[Path, str]]]:
    """The names of the reference files in `directory` fit to train on (logps.npy, or the parts so far), and
    those set aside: a file of the wrong shape, with a value that is not finite, or unreadable is renamed
    `*.damaged` and computed again, never trained on (a claim can be written to by hand, or damaged)."""
    sound, aside = [], []
    final = directory / "logps.npy"
    # Parts by their exact name: a write cut short leaves `part-N.npy.writing-PID.npy` (_write_aside), not a part.
    parts = sorted(p for p in directory.glob("part-*.npy") if re.fullmatch(r"part-\d{10}\.npy", p.name))
    files = [final] if final.is_file() else parts
    for path in files:
        first = 0 if path == final else int(path.stem.split("-")[1])
        want = (total, 2) if path == final else (min(PART_RECORDS, total - first), 2)
        try:
            array = np.load(path)
            reason = (
                f"{array.shape} values where {want} belong" if array.shape != want
                else "values that are not finite" if not np.isfinite(array).all() else ""
            )  # fmt: skip
        except (OSError, ValueError) as exc:
            reason = f"unreadable ({exc})"
        if not reason:
            sound.append(path.name)
            continue
        damaged = path.with_name(f"{path.name}.damaged")
        os.replace(path, damaged)
        aside.append((damaged, reason))
    return sound, aside


@torch.no_grad()
def precompute_reference(
    objective: Preference, module, source, directory: Path, env, micro: int, on_set_aside=None
) -> np.ndarray:
    """(records, 2) reference log-probabilities of every record of `source`'s cache (both splits), computed
    with the model as it is now (the starting weights; with LoRA, adapters whose B is zero), in parts of
    PART_RECORDS records that rank 0 writes as they are done; sound parts already on the claim are read, not
    computed again, and a damaged one is set aside (`on_set_aside(path, reason)` on rank 0) and computed again.
    Every rank runs as many forward passes (FSDP gathers parameters collectively): past the end, a rank
    recomputes record 0."""
    final = directory / "logps.npy"
    total = int(source.meta["records"])
    directory.mkdir(parents=True, exist_ok=True)
    have = [None]
    if env.is_main:
        have[0], aside = sound_reference_files(directory, total)
        for path, reason in aside:
            if on_set_aside is not None:
                on_set_aside(path, reason)
    dist.broadcast_object_list(have, src=0)
    if final.name in have[0]:
        return np.load(final)
    was_training = module.training
    module.eval()
    try:
        for first in range(0, total, PART_RECORDS):
            name = f"part-{first:010d}.npy"
            if name in have[0]:
                continue
            count = min(PART_RECORDS, total - first)
            part = torch.zeros(count, 2, dtype=torch.float64, device=env.device)
            for step in range(-(-count // (micro * env.world))):
                base = first + step * micro * env.world + env.rank * micro
                records = [base + j for j in range(micro)]
                batch = collate([source.pair(r if r < first + count else 0) for r in records])
                rows = pair_rows(batch.inputs.to(env.device))
                targets = pair_rows(batch.targets.to(env.device))
                # Under LoRA the starting adapters add exact zeros (B is zero): the model as built is the base.
                # (peft's disable_adapter would also mark the adapters frozen in FSDP2's first forward.)
                logps, _ = objective._policy_logps(module, rows, targets)
                pairs = logps.double().view(2, micro).T
                for j, r in enumerate(records):
                    if r < first + count:
                        part[r - first] = pairs[j]
            dist.all_reduce(part)  # each rank filled its own records; the others are zeros
            if env.is_main:
                _write_aside(directory / name, part.cpu().numpy())
    finally:
        module.train(was_training)
    dist.barrier()
    if env.is_main:
        parts = sorted(directory.glob("part-*.npy"))
        _write_aside(final, np.concatenate([np.load(p) for p in parts]))
        for p in parts:
            p.unlink()
    dist.barrier()
    return np.load(final)
