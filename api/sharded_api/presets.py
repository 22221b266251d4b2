"""The bundled model presets' shapes: pure Python, so the memory model (and the `sharded` command line,
which never imports torch) can read them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int = 4096
    tie_embeddings: bool = True
    rope_theta: float = 500_000.0
    norm_eps: float = 1e-5

    def num_params(self, embeddings: bool = True) -> int:
        head = self.dim // self.n_heads
        attn = self.dim * head * (self.n_heads * 2 + self.n_kv_heads * 2)
        ffn = 3 * self.dim * self.ffn_dim
        per_layer = attn + ffn + 2 * self.dim
        emb = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + self.dim + (emb if embeddings else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6·N (matmuls, fwd+bwd) + 12·L·d·T (attention scores), as torchtitan."""
        n = self.num_params(embeddings=False) + self.vocab_size * self.dim  # output projection is a matmul
        return 6 * n + 12 * self.n_layers * self.dim * seq_len


PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=1024),
    "llama-125m": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, vocab_size=32_000),
    "llama-1b": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128_256),
    "llama-8b": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14_336, vocab_size=128_256, tie_embeddings=False
    ),
}
