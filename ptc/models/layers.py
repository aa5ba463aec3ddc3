"""Building blocks shared by the built-in families: norms, MLPs, rotary tables.

Terms: h is the hidden size, a the attention heads, d = h / a the head size,
s the sequence length, b the micro-batch.
"""

from __future__ import annotations

import torch
from torch import nn

from ptc.plan import ModelSpec


def make_norm(kind: str, hidden: int, eps: float, bias: bool) -> nn.Module:
    """A LayerNorm or RMSNorm of width `hidden`.

    Both are torch.nn modules, so torch.fx keeps them as one `call_module`
    leaf: passes see "a norm" rather than its pow/mean/rsqrt pieces.
    """
    if kind == "rmsnorm":
        return nn.RMSNorm(hidden, eps=eps)
    return nn.LayerNorm(hidden, eps=eps, bias=bias)


def make_activation(kind: str) -> nn.Module:
    """The MLP non-linearity of a non-gated MLP ("gelu" is GPT-2's tanh form)."""
    if kind == "relu":
        return nn.ReLU()
    return nn.GELU(approximate="tanh")


class MLP(nn.Module):
    """`down(act(up(x)))`: the GPT MLP, h -> ffn -> h."""

    def __init__(self, hidden: int, ffn: int, activation: str, bias: bool, dropout: float):
        super().__init__()
        self.up = nn.Linear(hidden, ffn, bias=bias)
        self.act = make_activation(activation)
        self.down = nn.Linear(ffn, hidden, bias=bias)
        # Only present when used, so a dropout-free graph has no no-op nodes.
        self.drop = nn.Dropout(dropout) if dropout > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to x[b, s, h]."""
        y = self.down(self.act(self.up(x)))
        return self.drop(y) if self.drop is not None else y


class GatedMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))`: Llama's SwiGLU MLP, h -> ffn -> h."""

    def __init__(self, hidden: int, ffn: int, bias: bool):
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=bias)
        self.up = nn.Linear(hidden, ffn, bias=bias)
        self.down = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the SwiGLU MLP to x[b, s, h]."""
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def make_mlp(spec: ModelSpec, activation: str, bias: bool) -> nn.Module:
    """The MLP the spec asks for: gated (swiglu) or plain (gelu/relu)."""
    if activation == "swiglu":
        return GatedMLP(spec.hidden, spec.ffn_size, bias)
    return MLP(spec.hidden, spec.ffn_size, activation, bias, spec.dropout)


class RotaryTables(nn.Module):
    """RoPE cos/sin tables for positions 0..max_seq-1, as non-persistent buffers.

    Each attention module owns its tables so that every layer is
    self-contained (a pipeline stage needs nothing from another stage); the
    tables are recomputed, not loaded, hence non-persistent. We use the
    "rotate half" pairing (dimension i with i + d/2), as Hugging Face's Llama
    does; it is RoPE up to a fixed permutation of the q/k output channels.
    """

    def __init__(self, head_dim: int, max_seq: int, theta: float):
        super().__init__()
        self.head_dim, self.max_seq, self.theta = head_dim, max_seq, theta
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.empty(0).device.type == "meta":
            # Building on meta: only the shape matters, and computing the table
            # op by op on meta costs more than the rest of a 70B model's build.
            shape = (self.max_seq, self.head_dim)
            return torch.empty(shape), torch.empty(shape)
        # float64 keeps the angles of large positions accurate.
        half = torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim
        inv_freq = 1.0 / (self.theta ** half)
        angles = torch.outer(torch.arange(self.max_seq, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().float(), angles.sin().float()

    def reset_buffers(self) -> None:
        """Recompute the tables in place (after `to_empty` left them uninitialised)."""
        cos, sin = self._tables()
        with torch.no_grad():
            self.cos.copy_(cos)
            self.sin.copy_(sin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x[b, heads, s, d] by the angles of positions 0..s-1."""
        s = x.size(2)
        # torch.narrow, not self.cos[:s]: under torch.fx.symbolic_trace s is a
        # traced value, which a torch op accepts and Python slicing does not.
        cos = torch.narrow(self.cos, 0, 0, s).to(x.dtype)
        sin = torch.narrow(self.sin, 0, 0, s).to(x.dtype)
        return x * cos + rotate_half(x) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension's two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)
