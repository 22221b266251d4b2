"""A Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) that knows nothing of distribution."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from sharded_api.config import PURE_BF16, TrainerConfig
from sharded_api.presets import PRESETS, ModelArgs

# bf16-pure computes in bf16 too; it differs in what is stored (no fp32 master) and how the optimizer rounds.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, PURE_BF16: torch.bfloat16}


def cast_parameters(module: nn.Module, dtype: torch.dtype) -> None:
    """Every parameter of `module` held in `dtype` from now on (bf16-pure's weights, or a frozen copy's); the
    buffers keep theirs (a RoPE table in bf16 turns late positions' angles)."""
    with torch.no_grad():
        for param in module.parameters():
            param.data = param.data.to(dtype)


def model_args(preset: str, vocab_size: int | None = None, max_seq_len: int | None = None) -> ModelArgs:
    args = PRESETS[preset]
    changes = {}
    if vocab_size:
        changes["vocab_size"] = vocab_size
    if max_seq_len and max_seq_len > args.max_seq_len:
        changes["max_seq_len"] = max_seq_len
    return ModelArgs(**{**args.__dict__, **changes}) if changes else args


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, seq, heads, head_dim); cos, sin: (seq, head_dim / 2) in x's dtype. Rotating in the
    # activations' dtype avoids an fp32 round trip of q and k (~2% of an eager bf16 step).
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.dim // a.n_heads
        self.wq = nn.Linear(a.dim, a.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * self.head_dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = apply_rope(self.wq(x).view(b, t, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(b, t, self.n_kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.feed_forward = FeedForward(a)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Decoder-only LM. `forward(tokens) -> logits`; `layers` is a ModuleDict so parallelisms wrap blocks by name."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        # Not parameters and not saved: recomputed from args, so checkpoints stay shape-only.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() < 2:
                nn.init.ones_(p) if "norm" in name else nn.init.zeros_(p)
                continue
            scale = std / math.sqrt(2 * self.args.n_layers) if name.endswith(("wo.weight", "w2.weight")) else std
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * scale)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        # The tables are kept exact in fp32 and cast once per forward, not once per block.
        seq = tokens.shape[1]
        cos, sin = self.rope_cos[:seq].to(h.dtype), self.rope_sin[:seq].to(h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def build_model(cfg: TrainerConfig) -> Transformer:
    """The configured preset with its initial weights, the same on every rank before sharding."""
    args = model_args(cfg.model.preset_name, cfg.model.vocab_size, cfg.seq_len)
    model = Transformer(args)
    model.init_weights(cfg.seed)
    return model


class WeightSource(Protocol):
    """Initial values of a model built on the meta device, read for the rows a process keeps."""

    def read(self, name: str, shape: torch.Size, rows: tuple[int, int] | None, dtype: torch.dtype) -> torch.Tensor:
        """Parameter `name` (of full `shape`), only rows [rows[0], rows[1]) of its first dimension when given."""
        ...


@dataclass
class Network:
    """A model as the loop and the strategies see it, whatever built it (a preset or transformers)."""

    module: nn.Module
    fingerprint: dict  # what checkpoints of it can be resumed by (its shape, its adapters)
    flops_per_token: Callable[[int], float]  # training FLOPs per token at a sequence length, for MFU
    logits: Callable[[nn.Module, torch.Tensor, torch.Tensor | None], torch.Tensor]  # (module, inputs, positions)
    vocab_size: int
    # Set when the parameters are on the meta device: the strategy shards, then materializes from it.
    source: WeightSource | None = None
    # Only the trained parameters (LoRA adapters) are checkpointed; the frozen rest comes from `source`.
    adapter_only: bool = False
    # The 6·N convention's FLOPs per token (every weight's gradient counted), where they differ from those done.
    flops_per_token_6n: Callable[[int], float] | None = None
    attention: str | None = None  # a Hugging Face model's attention implementation, as transformers set it

    def flops_6n(self, seq_len: int) -> float:
        return (self.flops_per_token_6n or self.flops_per_token)(seq_len)


def _preset_logits(module: nn.Module, inputs: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    return module(inputs)  # one sequence per row: positions are implicit


def preset_network(cfg: TrainerConfig) -> Network:
    model = build_model(cfg)
    shape = {k: v for k, v in asdict(model.args).items() if k != "max_seq_len"}  # RoPE tables are not saved
    return Network(
        module=model, fingerprint=shape, flops_per_token=model.args.flops_per_token, logits=_preset_logits,
        vocab_size=model.args.vocab_size,
    )  # fmt: skip
