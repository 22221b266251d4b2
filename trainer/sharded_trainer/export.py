"""Consolidate a sharded checkpoint (FSDP/DCP or DeepSpeed ZeRO-2) into one safetensors file."""

from __future__ import annotations

from pathlib import Path

import torch

from sharded_trainer.checkpoint import committed_steps, step_dir
from sharded_trainer.config import TrainerConfig


def resolve_step_dir(path: str) -> Path:
    p = Path(path)
    if (p / "COMMITTED").is_file():
        return p
    steps = committed_steps(p)
    if not steps:
        raise FileNotFoundError(f"no committed checkpoint in {p}")
    return step_dir(p, steps[-1])


def load_model_state(cfg: TrainerConfig, directory: Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) model state dict, in one process, without a process group."""
    from sharded_trainer.train import build_model

    model = build_model(cfg)
    if cfg.strategy.type == "fsdp":
        import torch.distributed.checkpoint as dcp

        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=str(directory), no_dist=True)  # reads only the model's keys
        return state["model"]
    # ZeRO-2 keeps the full fp32 module weights in rank 0's model-states file.
    files = sorted((directory / "zero2").glob("mp_rank_00_model_states.pt"))
    if not files:
        raise FileNotFoundError(f"no DeepSpeed model states under {directory / 'zero2'}")
    module = torch.load(files[0], map_location="cpu", weights_only=False)["module"]
    return {k: v.float() for k, v in module.items()}


def export_checkpoint(cfg: TrainerConfig, checkpoint: str, out: str) -> Path:
    from safetensors.torch import save_file

    state = load_model_state(cfg, resolve_step_dir(checkpoint))
    # Tied embeddings share storage; safetensors stores each tensor once, so drop the alias.
    if cfg.model.preset != "llama-8b":
        state.pop("output.weight", None)
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_path))
    return out_path


def load_exported(cfg: TrainerConfig, path: str) -> torch.nn.Module:
    """A plain single-process model with the exported weights (the inverse of export_checkpoint)."""
    from safetensors.torch import load_file

    from sharded_trainer.train import build_model

    model = build_model(cfg)
    missing, unexpected = model.load_state_dict(load_file(path), strict=False)
    if unexpected or any(k != "output.weight" for k in missing):
        raise ValueError(f"export does not match the model: missing {missing}, unexpected {unexpected}")
    return model
