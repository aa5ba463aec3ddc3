"""Rewrite linears written as matrix products into `F.linear`, so tensor parallelism sees one form.

Models write a linear layer in more ways than `nn.Linear`: GPT-2's `Conv1D`
is `addmm(b, x.view(-1, in), W).view(..., out)` with a weight stored
[in, out]; hand-written code has `x @ W` or `torch.mm`. Tensor parallelism
must find the input, weight and bias of each, split the right dimension of
the weight and take a row-parallel bias out of the product. Rather than
teach every step each form, `to_linear_form` rewrites them, before the
tensor_parallel pass looks at the graph, into

    F.linear(x, W.t(), b)

which computes the same products (the transposed view of the weight is the
matrix the product multiplied by; no copy). The flatten of the leading dims
and the view back are dropped when they only fold and unfold them, so the
linear reads and returns the activations in their own shape. Which
dimension of the stored weight holds the output features is then
`nodes.linear_out_dim`: 1 for a Conv1D weight, 0 for nn.Linear's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from ptc.compiler.graph.meta import copy_meta, get_info
from ptc.compiler.graph.nodes import is_linear, op_name

_MATRIX_PRODUCTS = frozenset({"addmm", "mm", "matmul"})
_FOLDS = frozenset({"view", "reshape", "unsafe_view"})


def to_linear_form(gm: fx.GraphModule) -> int:
    """Rewrite every matrix-product linear of `gm` into F.linear; returns how many were."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and op_name(node) in _MATRIX_PRODUCTS and is_linear(node):
            done += _rewrite(gm, node)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _rewrite(gm: fx.GraphModule, node: fx.Node) -> int:
    """Replace one addmm / mm / matmul whose second operand is a weight; 0 if it is not plain."""
    if op_name(node) == "addmm":
        if len(node.args) != 3 or any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")) \
                or set(node.kwargs) - {"beta", "alpha"}:
            return 0
        bias, x, weight = node.args
        if _ndim(bias) != 1:
            return 0
    else:
        if len(node.args) != 2 or node.kwargs:
            return 0
        (x, weight), bias = node.args, None
    if _ndim(weight) != 2 or _ndim(x) is None or _ndim(x) < 2:
        return 0
    fold = x
    x, out = _unfolded(x, node)
    with gm.graph.inserting_before(node):
        transposed = gm.graph.call_function(torch.t, (weight,))
        linear = gm.graph.call_function(F.linear, (x, transposed, bias))
    copy_meta(node, transposed, kind="view", shapes=(tuple(reversed(_shape(weight))),),
              dtypes=get_info(weight).dtypes, flops=0, params=0, param_bytes=0)
    out_info = get_info(out)
    copy_meta(node, linear, kind="linear", shapes=out_info.shapes, dtypes=out_info.dtypes)
    out.replace_all_uses_with(linear)
    name = node.name
    for dead in (out, node) if out is not node else (node,):
        gm.graph.erase_node(dead)
    if fold is not x and not fold.users:
        gm.graph.erase_node(fold)
    linear.name = name
    return 1


def _unfolded(x: fx.Node, product: fx.Node) -> tuple[fx.Node, fx.Node]:
    """(input, output) of the linear: the activations before a flatten of their leading dims,
    and the product's one view that unfolds them again; else the product's own."""
    source = x.args[0] if op_name(x) in _FOLDS and x.args else None
    users = list(product.users)
    unfold = users[0] if len(users) == 1 and op_name(users[0]) in _FOLDS else None
    if source is None or unfold is None:
        return x, product
    before, after = _shape(source), _shape(unfold)
    folded, product_shape = _shape(x), _shape(product)
    if None in (before, after, folded, product_shape) or len(folded) != 2:
        return x, product
    if before[-1] != folded[-1] or after[:-1] != before[:-1] or after[-1] != product_shape[-1]:
        return x, product
    return source, unfold


def _shape(node) -> tuple[int, ...] | None:
    info = get_info(node) if isinstance(node, fx.Node) else None
    return tuple(info.shapes[0]) if info is not None and len(info.shapes) == 1 else None


def _ndim(node) -> int | None:
    shape = _shape(node)
    return None if shape is None else len(shape)
