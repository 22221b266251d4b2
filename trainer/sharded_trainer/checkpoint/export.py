"""Consolidate a sharded checkpoint into one safetensors file; the strategy that wrote it reads it back."""

from __future__ import annotations

from pathlib import Path

import torch

from sharded_api.config import TrainerConfig
from sharded_api.loading import ConfigError
from sharded_trainer.checkpoint.hf_export import export_hf
from sharded_trainer.checkpoint.manager import resolve_step_dir, saved_strategy
from sharded_trainer.modeling.decoder import build_model
from sharded_trainer.strategies.pick import strategy_class


def load_model_state(cfg: TrainerConfig, directory: Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) model state dict, in one process, without a process group."""
    return strategy_class(cfg.strategy.type).full_model_state(build_model(cfg), directory)


def export_checkpoint(cfg: TrainerConfig, checkpoint: str, out: str, *, merge: bool = False) -> Path:
    if cfg.strategy.type == "auto":  # the strategy the run settled on is the one its checkpoint names
        kind = saved_strategy(resolve_step_dir(checkpoint))
        if kind is None:
            raise ConfigError(f"{checkpoint}: the checkpoint does not say which strategy wrote it; set strategy.type")
        cfg = cfg.model_copy(update={"strategy": cfg.strategy.model_copy(update={"type": kind})})
    if cfg.model.huggingface is not None:
        return export_hf(cfg, checkpoint, out, merge=merge)
    from safetensors.torch import save_file

    directory = resolve_step_dir(checkpoint)
    state = load_model_state(cfg, directory)
    # Tied embeddings share storage; safetensors stores each tensor once, so drop the alias.
    if cfg.model.preset_name != "llama-8b":
        state.pop("output.weight", None)
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # What the numbers are: always float32, from the most precise copy the checkpoint holds.
    source = strategy_class(cfg.strategy.type).weights_source(directory)
    metadata = {"dtype": "float32", "trained_in": cfg.precision, "strategy": cfg.strategy.type, "weights": source,
                "checkpoint": directory.name}  # fmt: skip
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_path), metadata=metadata)
    return out_path


def load_exported(cfg: TrainerConfig, path: str) -> torch.nn.Module:
    """A plain single-process model with the exported weights (the inverse of export_checkpoint)."""
    from safetensors.torch import load_file

    model = build_model(cfg)
    missing, unexpected = model.load_state_dict(load_file(path), strict=False)
    if unexpected or any(k != "output.weight" for k in missing):
        raise ValueError(f"export does not match the model: missing {missing}, unexpected {unexpected}")
    return model
