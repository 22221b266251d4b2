"""A checkpoint of a Hugging Face model written back as a Hugging Face directory that serving stacks load:
config, tokenizer, sharded safetensors with an index; for LoRA, the adapter in peft's format and, on
request, the merged model. One process, no process group."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from sharded_api.config import TrainerConfig
from sharded_trainer.checkpoint.manager import resolve_step_dir
from sharded_trainer.modeling.build import build_network
from sharded_trainer.modeling.hf import load_hf_config
from sharded_trainer.strategies.parallel import materialize
from sharded_trainer.strategies.pick import strategy_class

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def stored_dtype(cfg: TrainerConfig) -> str:
    """The dtype the model directory's config declares (what it was released in), fp32 when it says none."""
    assert cfg.model.huggingface is not None
    dtype = getattr(load_hf_config(cfg.model.huggingface), "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return DTYPE_NAMES.get(dtype, "fp32")


def trained_model(cfg: TrainerConfig, checkpoint: str, dtype: str | None = None) -> torch.nn.Module:
    """The model with the checkpoint's weights (the base from the model directory under LoRA), on the CPU."""
    directory = resolve_step_dir(checkpoint)
    hf = cfg.model.huggingface
    assert hf is not None, "trained_model is for Hugging Face models"
    cfg = cfg.model_copy(deep=True)
    cfg.model.huggingface.dtype = dtype or stored_dtype(cfg)
    net = build_network(cfg)
    materialize(net.module, torch.device("cpu"), net.source)
    saved = strategy_class(cfg.strategy.type).full_model_state(net.module, directory)
    missing, unexpected = net.module.load_state_dict(saved, strict=False)
    if unexpected or (missing and not net.adapter_only):
        raise ValueError(f"checkpoint {directory} does not match the model: missing {missing}, unexpected {unexpected}")
    return net.module


def export_hf(cfg: TrainerConfig, checkpoint: str, out: str, *, merge: bool = False, dtype: str | None = None) -> Path:
    """Write `out` (replacing it whole, never half-written): the full model, or the LoRA adapter (and with
    `merge` the merged model under `out/merged`), with the model directory's tokenizer files."""
    from transformers import AutoTokenizer

    hf = cfg.model.huggingface
    assert hf is not None
    model = trained_model(cfg, checkpoint, dtype)
    target = Path(out)
    aside = target.with_name(f"{target.name}.writing-{os.getpid()}")
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir(parents=True)
    if cfg.lora is not None:
        model.peft_config["default"].base_model_name_or_path = hf.path
        model.save_pretrained(str(aside))  # adapter_config.json + adapter_model.safetensors
        if merge:
            model.merge_and_unload().save_pretrained(str(aside / "merged"), max_shard_size="4GB")
    else:
        model.save_pretrained(str(aside), max_shard_size="4GB")
    try:
        tokenizer = AutoTokenizer.from_pretrained(hf.path)
    except (OSError, ValueError):
        tokenizer = None  # a model directory without a tokenizer: the export has none either
    if tokenizer is not None:
        tokenizer.save_pretrained(str(aside))
        if merge and cfg.lora is not None:
            tokenizer.save_pretrained(str(aside / "merged"))
    if target.exists():
        shutil.rmtree(target)
    os.rename(aside, target)
    return target
