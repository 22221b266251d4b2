"""Which attention implementation a Hugging Face model is built with (model.huggingface.attention)."""

from __future__ import annotations

from sharded_api.config import RECORD_SOURCES, TrainerConfig
from sharded_api.loading import ConfigError


def attention_for(cfg: TrainerConfig, config, *, cuda: bool) -> str | None:
    """The attention implementation to ask transformers for; None: its own pick (torch's SDPA where the
    architecture supports it).

    auto picks FlexAttention for packed records on a GPU. Rows that hold several records carry position ids
    that restart, and transformers then gives SDPA an explicit block-diagonal mask, which rules out its flash
    kernel: on the 1.24B shape at seq 2048 that cost 10% of the step, FlexAttention's block mask (which also
    skips the blocks between records) under 1% (docs/benchmarks.md, data pipeline). Without packing the plain
    causal mask keeps SDPA's flash kernel, faster than FlexAttention's; on a CPU FlexAttention has no
    backward at all.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    spec = cfg.model.huggingface
    assert spec is not None
    if spec.attention == "flex_attention" and not cuda:
        raise ConfigError("model.huggingface.attention: flex_attention needs a GPU (torch's FlexAttention has no "
                          "backward on a CPU): use auto or sdpa")  # fmt: skip
    if spec.attention != "auto":
        return spec.attention
    packed = cfg.data.source in RECORD_SOURCES and cfg.data.packing and cfg.objective.type != "dpo"
    if not (packed and cuda) or spec.trust_remote_code:
        return None
    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:  # a config transformers has no causal-LM class for: leave the choice to it
        return None
    return "flex_attention" if getattr(model_class, "_supports_flex_attn", False) else None
