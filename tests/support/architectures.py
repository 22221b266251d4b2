"""The architecture matrix: for a causal-LM model type of the installed transformers, a tiny random model
written by `save_pretrained`, loaded once by `from_pretrained` and once by the trainer's sharded loader
(`build_hf`, then `materialize` from the files, as each rank does), the two models' logits compared, and the
decoder blocks FSDP2 shards one by one found in the loaded model."""

from __future__ import annotations

import json
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

# What the two loads must agree to (fp32): the same weights give the same logits up to kernel order.
TOLERANCE = 1e-5
MAX_PARAMS = 2_000_000  # a tiny model is about 30 thousand parameters


@dataclass
class Outcome:
    model_type: str
    status: str  # "loads" | "differs" (our load is wrong: a defect) | "no-tiny-model" (not ours to load)
    why: str = ""
    config: dict | None = None  # the tiny model's config.json
    params: int = 0  # the parameters transformers built


def check(model_type: str, directory: Path) -> Outcome:
    from transformers import AutoModelForCausalLM

    from sharded_api.config import TrainerConfig
    from sharded_trainer.modeling.hf import build_hf, hf_logits
    from sharded_trainer.strategies.parallel import decoder_layers, materialize
    from tinyhf import tiny_config

    try:
        config = tiny_config(model_type)
        with torch.device("meta"):  # a size the shrinking missed would not fit in memory: counted first
            params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if params > MAX_PARAMS:
            raise ValueError(f"{params} parameters after shrinking its config (a size it names otherwise)")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(str(directory))
        reference = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
        vocab = getattr(getattr(config, "text_config", config), "vocab_size", 64)
        inputs = torch.randint(0, min(vocab, 64), (1, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = reference(input_ids=inputs, use_cache=False).logits
    except Exception as e:  # any failure to make the tiny model is recorded, with its reason
        return Outcome(model_type, "no-tiny-model", _why(e))
    try:
        cfg = TrainerConfig.model_validate(
            {"model": {"preset": None, "huggingface": {"path": str(directory), "dtype": "fp32"}}, "precision": "fp32"}
        )
        net = build_hf(cfg)
        materialize(net.module, torch.device("cpu"), net.source)
        with torch.no_grad():
            got = hf_logits(net.module.eval(), inputs, None)
        torch.testing.assert_close(got, expected, rtol=TOLERANCE, atol=TOLERANCE)
        decoder_layers(net.module)  # FSDP2 finds the blocks to shard one by one, by the model's structure
    except Exception as e:  # the matrix reports every architecture, whatever went wrong
        return Outcome(model_type, "differs", _why(e))
    params = sum(p.numel() for p in reference.parameters())
    return Outcome(model_type, "loads", config=json.loads((directory / "config.json").read_text()), params=params)


def _why(e: Exception) -> str:
    frame = traceback.extract_tb(e.__traceback__)[-1]
    first = str(e).splitlines()[0][:200] if str(e) else ""
    return f"{type(e).__name__}: {first} ({Path(frame.filename).name}:{frame.lineno})"
