"""The global batch a world of processes trains with: the config's own accumulation, or the nearest to
`globalBatchSize`, and an elastic job's kept batch."""

from __future__ import annotations

from sharded_api.config import TrainerConfig, TrainingSpec


def with_kept_batch(cfg: TrainerConfig, procs_per_node: int) -> TrainerConfig:
    """The config with the global batch an elastic job keeps (that of `batch_nodes` nodes of
    `procs_per_node` processes) made explicit; unchanged where globalBatchSize is set or nothing is kept."""
    if cfg.global_batch_size is not None or cfg.batch_nodes is None:
        return cfg
    kept = cfg.micro_batch_size * cfg.grad_accum_steps * procs_per_node * cfg.batch_nodes
    return cfg.model_copy(update={"global_batch_size": kept})


def accumulation_for(cfg: TrainingSpec, world: int) -> tuple[int, int]:
    """(gradient accumulation steps, global batch) for `world` processes: the config's own accumulation, or
    the one whose batch lies nearest `global_batch_size` (the smaller on a tie: less time per step)."""
    per_pass = cfg.micro_batch_size * world
    if cfg.global_batch_size is None:
        return cfg.grad_accum_steps, per_pass * cfg.grad_accum_steps
    low = max(1, min(1024, cfg.global_batch_size // per_pass))
    high = min(1024, low + 1)
    accum = min((low, high), key=lambda a: (abs(a * per_pass - cfg.global_batch_size), a))
    return accum, accum * per_pass


def describe_batch(cfg: TrainingSpec, world: int) -> str:
    """The batch `world` processes train with, for people (the SettingChosen event)."""
    accum, global_batch = accumulation_for(cfg, world)
    text = f"global batch {global_batch} ({cfg.micro_batch_size} x {accum} accumulated x {world} processes)"
    if cfg.global_batch_size not in (None, global_batch):
        text += f", the nearest to globalBatchSize {cfg.global_batch_size} that {world} processes allow"
    return text
