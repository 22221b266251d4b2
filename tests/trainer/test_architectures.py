"""Every causal-LM architecture of the installed transformers, in one process: a tiny random model written by
`save_pretrained` is loaded by the trainer's sharded loader and must give `from_pretrained`'s logits (fp32).

tests/architectures.json records, for the installed transformers, the architectures that load (none of them
may stop loading), a ceiling on those that build but do not load (it only goes down), and those transformers
cannot build as a tiny model on CPU (not ours to load, listed with the reason). Each run writes what it found
to build/architectures.json: copy it over the record when an architecture starts loading. The architectures
docs/finetuning.md names as supported are the record's."""

from __future__ import annotations

import json
import re

import pytest

from support.architectures import check
from support.torchrun_jobs import ROOT

pytestmark = pytest.mark.trainer
RECORD = ROOT / "tests" / "architectures.json"
DOCS = ROOT / "docs" / "finetuning.md"


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    tmp = tmp_path_factory.mktemp("architectures")
    found = {t: check(t, tmp / t) for t in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)}
    by_status: dict = {"transformers": transformers.__version__}
    for status in ("loads", "differs", "no-tiny-model"):
        by_status[status] = {o.model_type: o.why for o in found.values() if o.status == status}
    by_status["loads"] = sorted(by_status["loads"])
    (ROOT / "build").mkdir(exist_ok=True)
    (ROOT / "build" / "architectures.json").write_text(json.dumps(by_status, indent=1) + "\n")
    for status in ("differs", "no-tiny-model"):
        print(f"\n{status}: {len(by_status[status])}")
        for model_type, why in by_status[status].items():
            print(f"  {model_type:28} {why}")
    print(f"\nloads: {len(by_status['loads'])}: {' '.join(by_status['loads'])}")
    return found


def test_every_architecture_that_builds_loads_through_the_sharded_loader_as_from_pretrained_does(outcomes):
    import transformers

    record = json.loads(RECORD.read_text())
    assert record["transformers"] == transformers.__version__, "tests/architectures.json is for another transformers"
    loads = {t for t, o in outcomes.items() if o.status == "loads"}
    differs = {t: o.why for t, o in outcomes.items() if o.status == "differs"}
    assert not set(record["loads"]) - loads, {t: outcomes[t].why for t in set(record["loads"]) - loads}
    assert len(differs) <= record["differsCeiling"], differs
    # The ones named here by the issue that prompted the matrix, and the ones the fine-tuning tier trains.
    assert {"gpt_neox", "llama", "qwen2", "qwen3", "mistral", "gemma", "phi", "starcoder2", "olmo2"} <= loads


def test_the_docs_name_as_supported_exactly_the_architectures_that_load():
    record = json.loads(RECORD.read_text())
    listed = re.search(r"<!-- architectures -->\n(.*?)\n<!-- /architectures -->", DOCS.read_text(), re.S)
    assert listed, f"{DOCS} has no architectures list"
    assert sorted(re.findall(r"`([\w-]+)`", listed.group(1))) == record["loads"]


def test_the_memory_model_counts_the_parameters_of_every_architecture_it_models(outcomes):
    """For each loading architecture of a family the memory model covers, its parameter count from config.json
    alone is the built model's, but for biases and norm offsets (at most a few percent at the matrix's width
    of 32, under 0.1% at released sizes); the others are refused as not modelled."""
    from sharded_trainer.memplan import EXPERT_KEYS, GATED_MLP, PLAIN_MLP, NotModelled, Shape

    modelled = 0
    for model_type, o in outcomes.items():
        if o.status != "loads":
            continue
        text = o.config.get("text_config") or o.config
        experts = any(isinstance(text.get(k), int) and text[k] > 1 for k in EXPERT_KEYS)
        if model_type in GATED_MLP | PLAIN_MLP and not experts:
            assert Shape.from_hf_config(o.config).params == pytest.approx(o.params, rel=0.05), model_type
            modelled += 1
        else:
            with pytest.raises(NotModelled):
                Shape.from_hf_config(o.config)
    assert modelled >= 20


def test_a_model_whose_files_miss_a_parameter_is_refused_before_training_naming_the_keys(tmp_path):
    """A file key the model does not use and a parameter no file key gives: a config error (exit code 2),
    naming both and the architecture, before any strategy touches the model."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from sharded_api.config import TrainerConfig
    from sharded_api.loading import ConfigError
    from sharded_trainer.modeling.hf import build_hf
    from tinyhf import tiny_config

    AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32).save_pretrained(str(tmp_path))
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["model.final_norm.weight"] = weights.pop("model.norm.weight")
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = TrainerConfig.model_validate({"model": {"preset": None, "huggingface": {"path": str(tmp_path)}}})
    with pytest.raises(ConfigError) as e:
        build_hf(cfg)
    assert "LlamaForCausalLM" in str(e.value) and "model.norm.weight" in str(e.value), e.value
    assert "model.final_norm.weight" in str(e.value), e.value


def test_a_checkpoint_of_the_base_model_without_its_prefix_loads_into_the_causal_lm(tmp_path):
    """Files written by the base model (`LlamaModel`: `layers.0...`, no `model.` prefix) with the output head
    tied to the embedding: the keys gain the prefix as `from_pretrained` gives it, the head stays tied, and
    the logits are `from_pretrained`'s."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    from sharded_api.config import TrainerConfig
    from sharded_trainer.modeling.hf import build_hf, hf_logits
    from sharded_trainer.strategies.parallel import materialize
    from tinyhf import tiny_config

    config = tiny_config("llama", tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModel.from_config(config, dtype=torch.float32).save_pretrained(str(tmp_path))
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(str(tmp_path))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "layers.0.self_attn.q_proj.weight" in f.keys() and "embed_tokens.weight" in f.keys()  # noqa: SIM118
    inputs = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()(inputs).logits
    cfg = TrainerConfig.model_validate({"model": {"preset": None, "huggingface": {"path": str(tmp_path)}}})
    net = build_hf(cfg)
    materialize(net.module, torch.device("cpu"), net.source)
    assert net.module.lm_head.weight is net.module.model.embed_tokens.weight
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(net.module.eval(), inputs, None), expected, rtol=1e-5, atol=1e-5)
