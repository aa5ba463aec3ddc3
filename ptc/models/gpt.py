"""GPT (GPT-2 / Megatron layout): learned positions, pre-LayerNorm blocks.

Module names are a contract with plan files ("layers.*.attn.qkv", ...):
`embed`, `pos_embed`, `layers.{i}.{attn_norm, attn.{qkv, o}, mlp_norm,
mlp.{up, down}}`, `norm`, `head`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ptc.models.layers import make_mlp, make_norm
from ptc.plan import ModelSpec


class GPTAttention(nn.Module):
    """Causal multi-head attention with one fused `qkv` projection and `o`.

    The attention is written out as matmul -> mask -> softmax -> dropout ->
    matmul rather than `F.scaled_dot_product_attention` because GPT is our
    Megatron reference: the attention scores, softmax output and dropout
    mask appear as graph nodes, so the activation memory read off the graph
    reproduces Korthikanti et al.'s `5·a·s/h` term, and attention dropout is
    an ordinary module. (Llama uses SDPA, the flash-attention path; capture
    recognises both forms.)
    """

    def __init__(self, spec: ModelSpec, bias: bool):
        super().__init__()
        self.heads = spec.heads
        self.kv_heads = spec.num_kv_heads
        self.head_dim = spec.hidden // spec.heads
        qkv_out = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.qkv = nn.Linear(spec.hidden, qkv_out, bias=bias)
        self.o = nn.Linear(self.heads * self.head_dim, spec.hidden, bias=bias)
        self.attn_drop = nn.Dropout(spec.dropout) if spec.dropout > 0 else None
        self.resid_drop = nn.Dropout(spec.dropout) if spec.dropout > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over x[b, s, h] causally; returns [b, s, h]."""
        b, s, _ = x.shape
        d = self.head_dim
        q, k, v = self.qkv(x).split(
            [self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q = q.view(b, s, self.heads, d).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, d).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, d).transpose(1, 2)
        if self.kv_heads != self.heads:  # a fixed config flag, not data: traces fine
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
        # Built from the scores (not torch.ones(s, s)) so that symbolic tracing,
        # where s is a traced value, can record it.
        future = torch.ones_like(scores[0, 0], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if self.attn_drop is not None:
            probs = self.attn_drop(probs)
        y = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, self.heads * d)
        y = self.o(y)
        return self.resid_drop(y) if self.resid_drop is not None else y


class GPTBlock(nn.Module):
    """One pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, spec: ModelSpec, norm: str, activation: str, bias: bool):
        super().__init__()
        self.attn_norm = make_norm(norm, spec.hidden, spec.norm_eps, bias)
        self.attn = GPTAttention(spec, bias)
        self.mlp_norm = make_norm(norm, spec.hidden, spec.norm_eps, bias)
        self.mlp = make_mlp(spec, activation, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to x[b, s, h]."""
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """GPT language model: forward(tokens[b, s]) -> logits[b, s, vocab]."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        norm = spec.norm or "layernorm"
        activation = spec.activation or "gelu"
        bias = True if spec.bias is None else spec.bias
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab, spec.hidden)
        self.pos_embed = nn.Embedding(spec.max_seq, spec.hidden)
        self.embed_drop = nn.Dropout(spec.dropout) if spec.dropout > 0 else None
        self.layers = nn.ModuleList(
            GPTBlock(spec, norm, activation, bias) for _ in range(spec.layers))
        self.norm = make_norm(norm, spec.hidden, spec.norm_eps, bias)
        self.head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        self.tied = True if spec.tied_embeddings is None else spec.tied_embeddings
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share `embed.weight` with `head.weight` when tied (again after `to_empty`)."""
        if self.tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits[b, s, vocab] of every position of tokens[b, s]."""
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.embed(tokens) + self.pos_embed(positions)
        if self.embed_drop is not None:
            x = self.embed_drop(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))
