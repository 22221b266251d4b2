"""Which attention implementation a Hugging Face model is built with: model.huggingface.attention, and what
auto picks for packed records (FlexAttention on a GPU, transformers' own pick elsewhere)."""

from __future__ import annotations

import pytest

from sharded_api.config import TrainerConfig
from sharded_api.loading import ConfigError
from sharded_trainer.modeling.attention import attention_for
from tinyhf import model_config


def config(attention: str = "auto", objective_type: str = "sft", **data) -> TrainerConfig:
    return TrainerConfig.model_validate({
        "model": {"huggingface": {"path": "/models/m", "attention": attention}},
        "data": {"source": "jsonl", "path": "/data/chat.jsonl", **data},
        "objective": {"type": objective_type},
    })  # fmt: skip


def hf(model_type: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type)


LLAMA = model_config("llama", 96, pad_token_id=0, eos_token_id=1)


def test_auto_picks_flex_attention_for_packed_records_on_a_gpu():
    assert attention_for(config(), LLAMA, cuda=True) == "flex_attention"
    assert attention_for(config(source="parquet", path="/data"), hf("qwen3"), cuda=True) == "flex_attention"


@pytest.mark.parametrize(
    ("cfg", "cuda"),
    [
        (config(), False),  # no FlexAttention backward on a CPU
        (config(packing=False), True),  # one record per row: the causal mask keeps SDPA's flash kernel
        (config(source="synthetic", path=None), True),
        (config(objective_type="dpo"), True),  # pairs are one per row, nothing packed
    ],
    ids=["cpu", "unpacked", "synthetic", "dpo"],
)
def test_auto_leaves_the_choice_to_transformers_elsewhere(cfg, cuda):
    assert attention_for(cfg, LLAMA, cuda=cuda) is None


def test_auto_leaves_the_choice_to_transformers_for_a_model_without_flex_attention():
    assert attention_for(config(), hf("gpt2"), cuda=True) is None  # transformers' GPT-2 has no FlexAttention
    trusted = config()
    trusted.model.huggingface.trust_remote_code = True  # code from the directory: its support is unknown
    assert attention_for(trusted, LLAMA, cuda=True) is None


def test_a_named_implementation_is_used_as_given():
    assert attention_for(config("sdpa"), LLAMA, cuda=True) == "sdpa"
    assert attention_for(config("eager"), LLAMA, cuda=False) == "eager"
    assert attention_for(config("flex_attention", packing=False), LLAMA, cuda=True) == "flex_attention"


def test_flex_attention_on_a_cpu_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"model\.huggingface\.attention: flex_attention needs a GPU .* use auto"):
        attention_for(config("flex_attention"), LLAMA, cuda=False)


def test_an_unknown_implementation_is_refused_by_the_schema():
    with pytest.raises(ValueError, match="attention"):
        config("flash_attention_9")
