"""Forward FLOPs of one node, from its kind and its operands' shapes.

The convention (one multiply-add = 2 FLOPs):
- linear and matmul (linear, mm, bmm, matmul, addmm, baddbmm): exactly
  2·m·n·k, i.e. 2 · numel(output) · k. Bias adds and the `add` of
  addmm/baddbmm are not counted.
- attention, fused (scaled_dot_product_attention): the two matmuls,
  2·B·s_q·s_kv·(d_k + d_v) with B the batch·heads of the query — for equal
  head sizes 4·b·a·s²·d. A causal mask is still counted in full (as
  Megatron and PaLM's MFU do), so the figure is the dense one; the work a
  causal flash kernel does, which the cost model prices, is half of it
  (`ptc.compiler.graph.work.CAUSAL_SHARE`). Written-out
  attention's two matmuls are counted as matmuls and sum to the same.
- elementwise, normalisation, softmax, dropout, reduction and loss ops: one
  FLOP per element of their largest tensor operand (input or output) — a
  deliberate underestimate (a LayerNorm is ~5/element) that keeps the
  number simple; it is a few percent of a transformer's matmul FLOPs.
- data movement, creation, embedding lookups: 0.
- a user leaf module of unknown type: its matmul/convolution FLOPs as
  torch.utils.flop_counter counts them on meta tensors (elementwise 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import fx
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from ptc.compiler.graph import nodes

ELEMENTWISE_KINDS = frozenset({"norm", "activation", "pointwise", "reduction", "softmax",
                               "dropout", "loss"})


def numel(shape) -> int:
    """Elements of a tensor of this shape."""
    return math.prod(shape)


def matmul_flops(left_shape, out_shape) -> int:
    """2·numel(out)·k, k the contracted size (last dim of the left operand)."""
    return 2 * numel(out_shape) * left_shape[-1]


def sdpa_flops(q_shape, k_shape, v_shape) -> int:
    """2·B·s_q·s_kv·(d_k + d_v) for q[..., s_q, d_k], k[..., s_kv, d_k], v[..., s_kv, d_v]."""
    rows = numel(q_shape[:-1])  # batch · heads · s_q
    return 2 * rows * k_shape[-2] * (q_shape[-1] + v_shape[-1])


def _shape(value):
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def needs_running(node: fx.Node, kind: str) -> bool:
    """Whether the node's FLOPs can only be known by running it under `count_flops`.

    True for user leaf modules of unknown type and for einsum.
    """
    if node.op == "call_module":
        return kind == "other"
    return kind in ("matmul", "attention") and nodes.op_name(node) == "einsum"


def node_flops(node: fx.Node, kind: str, args: tuple, kwargs: dict, out) -> int:
    """FLOPs of `node` given its evaluated (meta) arguments and output.

    `args`/`kwargs` hold the operand values (meta tensors, python values);
    `out` is the node's value. Nodes for which `needs_running` is true are
    counted by the caller with `count_flops` instead (this returns 0).
    """
    if needs_running(node, kind):
        return 0
    out_t = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
    if out_t is None:
        return 0
    if kind == "linear":
        x = args[0] if node.op == "call_module" else _left_operand(node, args, kwargs)
        return matmul_flops(x.shape, out_t.shape)
    if kind == "attention" and nodes.op_name(node) in nodes.ATTENTION_OPS:
        q, k, v = (args + (None,) * 3)[:3]
        q = q if q is not None else kwargs["query"]
        k = k if k is not None else kwargs["key"]
        v = v if v is not None else kwargs["value"]
        return sdpa_flops(q.shape, k.shape, v.shape)
    if kind in ("matmul", "attention"):
        return matmul_flops(_left_operand(node, args, kwargs).shape, out_t.shape)
    if kind in ELEMENTWISE_KINDS:
        sizes = [t.numel() for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        return max(sizes, default=0)
    return 0


def _left_operand(node: fx.Node, args: tuple, kwargs: dict) -> torch.Tensor:
    name = nodes.op_name(node)
    if name in ("addmm", "baddbmm", "addbmm"):
        return args[1] if len(args) > 1 else kwargs["mat1" if name == "addmm" else "batch1"]
    return args[0] if args else kwargs.get("input", kwargs.get("self"))


def count_flops(fn: Callable, *args, **kwargs):
    """Run fn(*args, **kwargs) under torch's FlopCounterMode; return (result, flops)."""
    counter = FlopCounterMode(display=False)
    with counter:
        result = fn(*args, **kwargs)
    return result, counter.get_total_flops()
