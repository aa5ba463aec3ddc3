"""Llama: RMSNorm, grouped-query attention with RoPE, SwiGLU MLP, no biases.

Module names are a contract with plan files: `embed`,
`layers.{i}.{attn_norm, attn.{q, k, v, o}, mlp_norm, mlp.{gate, up, down}}`,
`norm`, `head`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ptc.models.layers import RotaryTables, make_mlp, make_norm
from ptc.plan import ModelSpec


class LlamaAttention(nn.Module):
    """Causal grouped-query attention: a query heads share kv_heads key/value heads.

    Uses `F.scaled_dot_product_attention` (with `enable_gqa`), the flash /
    memory-efficient path Llama is trained with: no s x s score tensor is
    kept, and key/value heads are not materialised a/kv times.
    """

    def __init__(self, spec: ModelSpec, bias: bool):
        super().__init__()
        self.heads = spec.heads
        self.kv_heads = spec.num_kv_heads
        self.head_dim = spec.hidden // spec.heads
        self.q = nn.Linear(spec.hidden, self.heads * self.head_dim, bias=bias)
        self.k = nn.Linear(spec.hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v = nn.Linear(spec.hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o = nn.Linear(self.heads * self.head_dim, spec.hidden, bias=bias)
        self.rope = RotaryTables(self.head_dim, spec.max_seq, spec.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over x[b, s, h] causally; returns [b, s, h]."""
        b, s, _ = x.shape
        d = self.head_dim
        q = self.rope(self.q(x).view(b, s, self.heads, d).transpose(1, 2))
        k = self.rope(self.k(x).view(b, s, self.kv_heads, d).transpose(1, 2))
        v = self.v(x).view(b, s, self.kv_heads, d).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o(y.transpose(1, 2).reshape(b, s, self.heads * d))


class LlamaBlock(nn.Module):
    """One pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, spec: ModelSpec, norm: str, activation: str, bias: bool):
        super().__init__()
        self.attn_norm = make_norm(norm, spec.hidden, spec.norm_eps, bias)
        self.attn = LlamaAttention(spec, bias)
        self.mlp_norm = make_norm(norm, spec.hidden, spec.norm_eps, bias)
        self.mlp = make_mlp(spec, activation, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to x[b, s, h]."""
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Llama language model: forward(tokens[b, s]) -> logits[b, s, vocab]."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        norm = spec.norm or "rmsnorm"
        activation = spec.activation or "swiglu"
        bias = False if spec.bias is None else spec.bias
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleList(
            LlamaBlock(spec, norm, activation, bias) for _ in range(spec.layers))
        self.norm = make_norm(norm, spec.hidden, spec.norm_eps, bias)
        self.head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        self.tied = bool(spec.tied_embeddings)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share `embed.weight` with `head.weight` when tied (again after `to_empty`)."""
        if self.tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits[b, s, vocab] of every position of tokens[b, s]."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))
