"""Tiny Hugging Face models of each architecture, a word-level tokenizer built here with `tokenizers`, and a
learnable chat task: what the fine-tuning tests and `make demo ARGS=--finetune` need, made with no network.

The task: the user says `next wK`, the assistant answers `wK+1 wK+2`. Chance on the answer is ln(vocab);
a model that learned it predicts the answer almost surely, and greedy generation reproduces it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma")
# Architectures whose files and modules differ (GPT-NeoX's `embed_out` is the model's `lm_head`; StarCoder2's
# plain MLP with biases): the fine-tuning tier trains them with LoRA under each strategy.
LORA_ARCHITECTURES = ("gpt_neox", "starcoder2")


def question(k: int) -> list[dict]:
    return [{"role": "user", "content": f"next w{k}"}]


def answer(k: int) -> str:
    return f"w{(k + 1) % len(WORDS)} w{(k + 2) % len(WORDS)}"


def write_tokenizer(directory: Path, *, byte_level: bool = False):
    """A word-level tokenizer (one token per word), or with `byte_level` a byte-level BPE trained here on the
    task's words, as Qwen's tokenizers are: transformers gives a Qwen model directory its own tokenizer
    class, which reads a byte-level BPE's vocabulary and merges but not a word-level vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if byte_level:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
        tok.train_from_iterator([" ".join(["next", *WORDS])] * 10, trainer)
    else:
        vocab = {t: i for i, t in enumerate([*SPECIAL, "next", *WORDS, "[UNK]"])}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token=None if byte_level else "[UNK]",
        additional_special_tokens=SPECIAL[2:],
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))
    return fast


def model_config(arch: str, vocab_size: int, *, pad_token_id: int, eos_token_id: int):
    from transformers import AutoConfig

    shape = {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
        "pad_token_id": pad_token_id, "eos_token_id": eos_token_id, "bos_token_id": None,
        "tie_word_embeddings": arch in ("gemma", "qwen2"),
        # Wide enough an output head that adapters alone (which leave it frozen) can make confident predictions.
        "initializer_range": 0.2,
    }  # fmt: skip
    return AutoConfig.for_model(arch, **shape)


def write_model(directory: Path, arch: str, *, seed: int = 0, shards: bool = False) -> Path:
    """A randomly initialised model of `arch` with the test tokenizer, as save_pretrained writes it."""
    import torch
    from transformers import AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(directory, byte_level=arch.startswith("qwen"))
    # A few spare rows: a model type's own tokenizer class may add a token of its own.
    config = model_config(arch, len(tokenizer) + 8, pad_token_id=tokenizer.pad_token_id,
                          eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Small shards exercise the index file and reads that span files.
    model.save_pretrained(str(directory), max_shard_size="100KB" if shards else "1GB")
    return directory


def write_chat_data(path: Path, records: int = 400, *, seed: int = 0, system_every: int = 0) -> Path:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for n in range(records):
            k = rng.randrange(len(WORDS))
            messages = [*question(k), {"role": "assistant", "content": answer(k)}]
            if system_every and n % system_every == 0:
                messages.insert(0, {"role": "system", "content": "next"})
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def wrong_answer(k: int, rng: random.Random) -> str:
    """Two words that are not question k's answer: a rejected answer the model must learn to rank lower."""
    while True:
        words = f"w{rng.randrange(len(WORDS))} w{rng.randrange(len(WORDS))}"
        if words != answer(k):
            return words


def write_preference_data(path: Path, records: int = 400, *, seed: int = 0) -> Path:
    """Preference records of the chat task: the right answer chosen, two other words rejected (chat prompts,
    answers as a string or an assistant message, as users' files mix them)."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for n in range(records):
            k = rng.randrange(len(WORDS))
            chosen, rejected = answer(k), wrong_answer(k, rng)
            if n % 2:
                chosen = [{"role": "assistant", "content": chosen}]
            f.write(json.dumps({"prompt": question(k), "chosen": chosen, "rejected": rejected}) + "\n")
    return path


def greedy_answer(model, tokenizer, k: int) -> str:
    """The model's greedy completion of question k, as words (special tokens dropped)."""
    import torch

    # Without the template's trailing space: a byte-level BPE merges it into the answer's first token.
    prompt = tokenizer.apply_chat_template(question(k), tokenize=False, add_generation_prompt=True).rstrip()
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=end)  # fmt: skip
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


# The shape of a tiny model of any architecture: each of these a config has (under whichever name its family
# uses) is set small; sizes stay consistent (heads x head_dim = hidden, experts >= experts per token).
TINY = {
    "vocab_size": 96, "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64, "seq_length": 64,
    "hidden_size": 32, "n_embd": 32, "d_model": 32, "dim": 32, "embed_dim": 32,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "decoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "decoder_attention_heads": 4,
    "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2, "head_dim": 8, "kv_channels": 8,
    "intermediate_size": 64, "n_inner": 64, "ffn_dim": 64, "decoder_ffn_dim": 64, "ffn_hidden_size": 64,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "expert_intermediate_size": 16,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "n_shared_experts": 1, "num_shared_experts": 1,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "rotary_dim": 4,
    # Token ids a config names must be inside the small vocabulary.
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


def tiny_config(model_type: str, **extra):
    """A tiny config of `model_type`: its defaults with every size of TINY it has made small (sub-configs
    such as a text config too). Raises whatever the config class raises on the result."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    return cls(**_tiny_kwargs(cls), **extra)


def _tiny_kwargs(cls) -> dict:
    default = cls()
    # A setting the class derives (a property) is not passed: it follows from the others.
    settable = [k for k in default.to_dict() if not isinstance(getattr(cls, k, None), property)]
    kwargs = {k: v for k, v in TINY.items() if k in settable}
    if "qk_rope_head_dim" in kwargs and "head_dim" in kwargs:  # multi-head latent attention: the rotary part
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    layers = next((kwargs[k] for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if k in kwargs), 2)
    for key in ("layer_types", "block_types", "mlp_layer_types", "hybrid_override_pattern"):
        if key not in settable:
            continue
        value = getattr(default, key, None)
        if isinstance(value, (list, str)) and len(value) > layers:
            kwargs[key] = value[:layers]
    from transformers import PretrainedConfig

    for name, sub in (getattr(cls, "sub_configs", None) or {}).items():
        if isinstance(sub, type) and issubclass(sub, PretrainedConfig) and getattr(default, name, None) is not None:
            kwargs[name] = _tiny_kwargs(sub)
    return kwargs
