"""Hugging Face causal LMs through transformers' own classes: built on the meta device, their weights read
from the directory's safetensors files by each rank for exactly the rows it keeps, LoRA through peft.

Nothing here knows how parameters are laid out over processes: `parallel.materialize` asks a `WeightSource`
for the rows each rank keeps, and the source reads only those bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from sharded_api.config import HuggingFaceModel, TrainerConfig
from sharded_api.loading import ConfigError
from sharded_trainer.modeling.attention import attention_for
from sharded_trainer.modeling.decoder import DTYPES, Network

# Names a wrapper adds to a parameter's path that the model's own files do not have: peft's wrapper and
# adapted layers, activation checkpointing's wrapper, torch.compile's.
_WRAPPER_PARTS = ("base_model.model.", ".base_layer", "_checkpoint_wrapped_module.", "_orig_mod.")


class ModelDirectoryError(ConfigError):
    """The model directory is missing or incomplete; the message says what to fix (a permanent failure:
    exit code 2, as an invalid config)."""


def load_hf_config(spec: HuggingFaceModel):
    from transformers import AutoConfig

    directory = Path(spec.path)
    if not (directory / "config.json").is_file():
        raise ModelDirectoryError(
            f"model.huggingface.path {spec.path}: no config.json there; give a Hugging Face model directory "
            "(config.json, *.safetensors, tokenizer files), e.g. one written by save_pretrained"
        )
    try:
        return AutoConfig.from_pretrained(str(directory), trust_remote_code=spec.trust_remote_code)
    except ValueError as e:  # an unknown model_type, or code that trustRemoteCode would allow
        raise ModelDirectoryError(f"model.huggingface.path {spec.path}: {e}") from e


def checkpoint_key(name: str) -> str:
    """The name a parameter has in the model's own safetensors files."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


class SafetensorsWeights:
    """The weights of a Hugging Face directory, read tensor by tensor (and row range by row range) from its
    safetensors files: a rank that keeps a shard reads only that shard's bytes."""

    def __init__(self, directory: str):
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ModelDirectoryError(f"{index}: not a safetensors index with a weight_map ({e})") from e
            # The index names files of this directory only: no path may lead out of it.
            outside = sorted({f for f in weight_map.values() if not isinstance(f, str) or Path(f).name != f})
            if outside:
                raise ModelDirectoryError(f"{index}: weight files must be in the model directory, got {outside[:3]}")
            self.files = {k: self.directory / f for k, f in weight_map.items()}
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            if not files:
                raise ModelDirectoryError(f"model.huggingface.path {directory}: no *.safetensors weights there")
            from safetensors import safe_open

            self.files = {}
            for f in files:
                with safe_open(str(f), "pt") as st:
                    self.files.update(dict.fromkeys(st.keys(), f))
        self._open: dict[Path, object] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def read(self, key: str, rows: tuple[int, int] | None, dtype: torch.dtype | None) -> torch.Tensor:
        from safetensors import safe_open

        path = self.files[key]
        if path not in self._open:
            self._open[path] = safe_open(str(path), "pt")
        piece = self._open[path].get_slice(key)
        tensor = piece[rows[0] : rows[1]] if rows is not None else piece[:]
        return tensor if dtype is None else tensor.to(dtype)

    def shape(self, key: str) -> list[int]:
        from safetensors import safe_open

        path = self.files[key]
        if path not in self._open:
            self._open[path] = safe_open(str(path), "pt")
        return list(self._open[path].get_slice(key).get_shape())


class CheckpointKeys:
    """Where each of the model's parameters is in its files, found as `from_pretrained` finds it: with
    transformers' own conversion mapping for the model's classes (renamings such as GPT-NeoX's `embed_out` to
    `lm_head`, legacy names, a checkpoint written with or without the base model's prefix) and its converters
    (tensors the files keep fused or split differently from the module: stacked experts, merged projections).

    A renamed tensor is read as it is, row range by row range. A converted one needs its whole sources: they
    are read whole, converted once by transformers' own operations, and each target's rows are cut from the
    result (kept only until every target of that conversion has been read)."""

    def __init__(self, model: nn.Module, weights: SafetensorsWeights):
        from copy import deepcopy

        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        self.model, self.weights = model, weights
        mapping = get_model_conversion_mapping(model)
        renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        converters = [t for t in mapping if isinstance(t, WeightConverter)]
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        wanted = model.state_dict()  # meta tensors: only the names matter
        prefix = getattr(model, "base_model_prefix", None)
        self.direct: dict[str, str] = {}  # the model's name -> the file's key
        self.groups: dict[str, tuple[object, list[tuple[str, str]]]] = {}  # first target -> converter, sources
        self.group_of: dict[str, str] = {}  # every converted target -> its group's first target
        self.unused: list[str] = []
        for key in sorted(weights.files, key=dot_natural_key):
            name, pattern = rename_source_key(key, renamings, converters, prefix, wanted)
            if name not in wanted and key in wanted:  # as from_pretrained: a key already right stays
                name, pattern = rename_source_key(key, [], [], prefix, wanted)
            if name not in wanted:
                self.unused.append(key)
            elif pattern is None:
                self.direct[name] = key
            else:
                converter, sources = self.groups.setdefault(name, (deepcopy(by_pattern[pattern]), []))
                sources.append((key, pattern))
                for target in converter.target_patterns:
                    self.group_of[name.replace(converter.target_patterns[0], target)] = name
        self._converted: dict[str, torch.Tensor] = {}
        # A tied parameter is registered under several names and the files keep one of them, not always the
        # one named first (CamemBERT's output head is registered before the embedding it shares).
        names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        self.aliases = {name: group for group in names.values() for name in group}

    def _source(self, name: str) -> str | None:
        """The name under which the files give this parameter, or None."""
        return next((n for n in self.aliases.get(name, [name]) if n in self.direct or n in self.group_of), None)

    def missing(self, names: list[str]) -> list[str]:
        return [n for n in names if self._source(n) is None]

    def check(self, model: nn.Module) -> None:
        """Every parameter the model owns has a source in the files, or the run stops before training (exit
        code 2) naming the parameters, the keys left over and the architecture."""
        missing = self.missing([checkpoint_key(n) for n, _ in model.named_parameters()])
        if missing:
            arch = type(self.model).__name__
            raise ModelDirectoryError(
                f"{self.weights.directory}: {arch} has {len(missing)} parameter(s) that transformers' key mapping "
                f"for this architecture finds in none of the safetensors files: {missing[:4]}; keys the files "
                f"have and the model does not use: {self.unused[:4]}"
            )

    def shape(self, name: str) -> list[int]:
        name = self._source(name) or name
        if name in self.direct:
            return self.weights.shape(self.direct[name])
        return list(self._convert(name).shape)

    def read(self, name: str, rows: tuple[int, int] | None, dtype: torch.dtype) -> torch.Tensor:
        name = self._source(name) or name
        if name in self.direct:
            return self.weights.read(self.direct[name], rows, dtype)
        whole = self._converted.pop(name, None)
        if whole is None:
            whole = self._convert(name)
            self._converted.pop(name)
        piece = whole if rows is None else whole[rows[0] : rows[1]]
        return piece.to(dtype)

    def _convert(self, name: str) -> torch.Tensor:
        from copy import deepcopy

        if name not in self._converted:
            first = self.group_of[name]
            converter, sources = self.groups[first]
            converter = deepcopy(converter)
            for key, pattern in sources:
                converter.add_tensor(first, key, pattern, lambda key=key: self.weights.read(key, None, None))
            for target, value in converter.convert(first, model=self.model, config=self.model.config).items():
                self._converted[target] = value[0] if isinstance(value, list) else value
        return self._converted[name]


class HfWeightSource:
    """Every parameter's initial value: the directory's weights for the base model (found through
    `CheckpointKeys`), LoRA's own initialisation (A: Kaiming-uniform from a generator seeded by the parameter's
    name, B: zeros) for the adapters."""

    def __init__(self, keys: CheckpointKeys, seed: int):
        self.keys, self.seed = keys, seed

    def read(self, name: str, shape: torch.Size, rows: tuple[int, int] | None, dtype: torch.dtype) -> torch.Tensor:
        key = checkpoint_key(name)
        if ".lora_B." in name:
            return torch.zeros(_rows_shape(shape, rows), dtype=dtype)
        if ".lora_A." in name:
            # The whole matrix, so every rank draws the same numbers whatever its shard (adapters are small).
            digest = hashlib.sha256(f"{self.seed}:{key}".encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
            full = torch.empty(shape, dtype=torch.float32)
            nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=g)  # peft's (and nn.Linear's) default
            return (full if rows is None else full[rows[0] : rows[1]]).to(dtype)
        directory = self.keys.weights.directory
        if self.keys.missing([key]):
            raise ModelDirectoryError(f"{directory}: the model has {key}, the safetensors files do not")
        saved = self.keys.shape(key)
        if saved != list(shape):
            raise ModelDirectoryError(
                f"{directory}: {key} is {saved} in the safetensors files, {list(shape)} in config.json"
            )
        return self.keys.read(key, rows, dtype)


def _rows_shape(shape: torch.Size, rows: tuple[int, int] | None) -> list[int]:
    return list(shape) if rows is None else [rows[1] - rows[0], *shape[1:]]


def base_dtype(cfg: TrainerConfig) -> torch.dtype:
    """The dtype the model is built in. auto: fp32 for trained weights under FSDP2 (the master copy the
    optimizer steps); the compute precision for a frozen LoRA base, under bf16-pure (there is no master), and
    under ZeRO-2 (DeepSpeed casts the module to it and keeps its fp32 master in the optimizer partitions), so
    the weights are read once, in the dtype the run keeps them in."""
    spec = cfg.model.huggingface
    assert spec is not None
    if spec.dtype != "auto":
        return DTYPES[spec.dtype]
    if cfg.lora is not None or cfg.strategy.type == "zero2" or cfg.pure_bf16:
        return DTYPES[cfg.precision]
    return torch.float32


def add_lora(model: nn.Module, cfg: TrainerConfig) -> nn.Module:
    """peft's LoRA on the (meta) model: the base frozen, adapters on the target modules (fp32 over a
    low-precision base)."""
    from peft import LoraConfig, get_peft_model

    lora = cfg.lora
    assert lora is not None
    targets = "all-linear" if lora.target_modules == ["all-linear"] else list(lora.target_modules)
    config = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets, bias="none",
        task_type="CAUSAL_LM",
    )  # fmt: skip
    try:
        return get_peft_model(model, config, autocast_adapter_dtype=True)
    except ValueError as e:  # target modules that match nothing
        raise ModelDirectoryError(f"lora.targetModules {lora.target_modules}: {e}") from e


def linear_params(model: nn.Module, trainable: bool | None = None) -> int:
    """Parameters of the linear layers (the matmuls), optionally only the trained or the frozen ones."""
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            for p in module.parameters(recurse=False):
                if p.dim() == 2 and (trainable is None or p.requires_grad == trainable):
                    total += p.numel()
    return total


def build_hf(cfg: TrainerConfig) -> Network:
    """The configured Hugging Face model, its parameters on the meta device (buffers such as RoPE tables are
    computed for real, they are not in the files); `materialize` fills them after the strategy shards."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    spec = cfg.model.huggingface
    assert spec is not None
    config = load_hf_config(spec)
    weights = SafetensorsWeights(spec.path)
    dtype = base_dtype(cfg)
    with init_empty_weights(include_buffers=False):
        attention = attention_for(cfg, config, cuda=torch.cuda.is_available())
        chosen = {} if attention is None else {"attn_implementation": attention}
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=spec.trust_remote_code,
                                                 **chosen)  # fmt: skip
    # Tying assigns a parameter, which the meta context above turned into a new one: tie again outside it.
    model.tie_weights()
    model.config.use_cache = False  # training: no KV cache (packed sequences need none either)
    keys = CheckpointKeys(model, weights)
    keys.check(model)  # before any strategy or process group touches the model
    fuse_rms_norms(model)
    if cfg.lora is not None:
        model = add_lora(model, cfg)
    text = getattr(config, "text_config", config)
    layers, hidden = text.num_hidden_layers, text.hidden_size
    frozen, trained = linear_params(model, trainable=False), linear_params(model, trainable=True)

    # A frozen weight costs forward and the input-gradient matmul (4 FLOPs per parameter and token), a
    # trained one the weight gradient too (6); attention scores 12·L·d·T as for the presets.
    def flops_per_token(seq_len: int) -> float:
        return 4 * frozen + 6 * trained + 12 * layers * hidden * seq_len

    def flops_per_token_6n(seq_len: int) -> float:  # the convention, for comparison with other trainers' MFU
        return 6 * (frozen + trained) + 12 * layers * hidden * seq_len

    shape_keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")  # fmt: skip
    shape = {k: v for k in shape_keys if (v := _setting(text, k)) is not None}
    fingerprint = {"huggingface": shape}
    if cfg.lora is not None:
        fingerprint["lora"] = cfg.lora.model_dump(by_alias=True, mode="json", exclude={"dropout"})
    return Network(
        module=model, fingerprint=fingerprint, flops_per_token=flops_per_token, flops_per_token_6n=flops_per_token_6n,
        source=HfWeightSource(keys, cfg.seed), logits=hf_logits, adapter_only=cfg.lora is not None,
        vocab_size=text.vocab_size, attention=getattr(model.config, "_attn_implementation", None),
    )  # fmt: skip


def _setting(config: object, key: str) -> object:
    # Some configs refuse to give one value for a setting that varies by layer (Gemma 4's head_dim).
    try:
        return getattr(config, key, None)
    except Exception:  # whatever the config raises, the setting has no single value
        return None


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    return (a.co_code, a.co_consts, a.co_names, a.co_varnames) == (b.co_code, b.co_consts, b.co_names, b.co_varnames)


def fuse_rms_norms(model: nn.Module) -> int:
    """Compute the RMSNorms whose code is Llama's with torch's fused kernel; return how many.

    Llama's norm (copied verbatim into Mistral, Qwen2/3, Phi-3 and others) runs six elementwise kernels each
    way with an fp32 copy of the activations; 2L+1 of them cost about a tenth of an eager 1B step on an H200.
    `F.rms_norm` computes the same function in one kernel, in fp32 inside, and rounds once where Llama's
    code rounds before the weight multiply. Only norms whose `forward` is Llama's bytecode are swapped, so a
    variant with other math (Gemma's `1 + weight`, OLMo-2's rounding after the multiply) keeps its own.
    Parameters and their names are untouched: checkpoints and exports do not see the swap.
    """
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    reference = LlamaRMSNorm.forward.__code__
    fused = 0
    for module in model.modules():
        code = getattr(type(module).forward, "__code__", None)
        weight = getattr(module, "weight", None)
        if code is None or not _same_code(code, reference) or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            continue
        module.forward = types.MethodType(_fused_rms_norm, module)
        fused += 1
    return fused


def _fused_rms_norm(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    if self.weight.dtype != hidden.dtype:  # Llama's code promotes to the wider dtype; keep its result type
        return type(self).forward(self, hidden)
    return F.rms_norm(hidden, self.weight.shape, self.weight, self.variance_epsilon)


def hf_logits(module: nn.Module, inputs: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    # Position ids that restart mark packed records: transformers then masks attention between them.
    return module(input_ids=inputs, position_ids=positions, use_cache=False).logits
