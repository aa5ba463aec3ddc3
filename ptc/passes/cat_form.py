"""Rewrite a tensor made blank and filled slice by slice in place into the cat of its slices.

DeepSeek-V3's attention builds its keys as

    k = kv.new_empty(b, heads, s, d_nope + d_rope)
    k[..., :d_nope].copy_(k_nope)
    k[..., d_nope:].copy_(k_rope)

which an exported graph records as a `new_empty`, and a `slice` with an in-place
`copy_` into it per piece. Its value is `cat([k_nope, k_rope], -1)`, but the
in-place form hides that from the dataflow: tensor parallelism traces an
attention's keys back to the linears they come from, and the blank spells out
the whole heads count, which a rank holding part of the heads must not allocate.
`to_cat_form` rewrites, before the pass looks at the graph, each blank tensor
whose slices along one dim tile it, each filled whole by one `copy_` of a tensor
of that slice's shape and dtype, and which is read only after the last copy,
into that cat. Anything else is left as it is.
"""

from __future__ import annotations

import torch
from torch import fx

from ptc.compiler.graph.meta import copy_meta, get_info
from ptc.compiler.graph.nodes import node_shape, op_name

_BLANKS = frozenset({"empty", "new_empty", "zeros", "new_zeros"})
"""Creation ops whose values a full tiling of copies overwrites."""


def to_cat_form(gm: fx.GraphModule) -> int:
    """Rewrite every blank tensor of `gm` filled slice by slice into a cat; returns how many."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    done = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and op_name(node) in _BLANKS:
            fill = _fill(node, order)
            if fill is not None:
                _rewrite(gm, node, *fill, order)
                done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _fill(blank: fx.Node, order: dict[fx.Node, int]) -> tuple[int, list[fx.Node]] | None:
    """(dim, the copy_ nodes in slice order) when `blank`'s slices along one dim tile it,
    each filled by one copy_ of a tensor of its shape and dtype, and every other reader of
    `blank` comes after the last copy; else None."""
    shape, dtype = node_shape(blank), _dtype(blank)
    slices = [u for u in blank.users if op_name(u) == "slice" and u.args[0] is blank]
    if shape is None or not slices:
        return None
    pieces: dict[tuple[int, int, int], fx.Node] = {}  # (dim, start, end) -> its copy_
    for cut in slices:
        bounds = _bounds(cut, shape)
        copies = list(cut.users)
        if bounds is None or len(copies) != 1:
            return None
        (copy,) = copies
        source = copy.args[1] if len(copy.args) == 2 else None
        if op_name(copy) != "copy_" or copy.args[0] is not cut or copy.users or \
                source is None or node_shape(source) != node_shape(cut) or \
                _dtype(source) != dtype:
            return None
        pieces[bounds] = copy
    ordered = sorted(pieces)
    dims = {dim for dim, _, _ in ordered}
    ends = [0] + [end for _, _, end in ordered]
    if len(dims) != 1 or [start for _, start, _ in ordered] != ends[:-1] or \
            ends[-1] != shape[ordered[0][0]]:
        return None
    last = max(order[copy] for copy in pieces.values())
    if any(order[u] < last for u in blank.users if u not in slices):
        return None
    return ordered[0][0], [pieces[key] for key in ordered]


def _bounds(cut: fx.Node, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """(dim, start, end) of a step-1 slice with constant bounds, clamped to `shape`."""
    args = list(cut.args) + [None] * (5 - len(cut.args))  # aten.slice(x, dim, start, end, step)
    dim, start, end, step = args[1] or 0, args[2] or 0, args[3], args[4] or 1
    size = shape[dim % len(shape)] if isinstance(dim, int) else None
    end = size if end is None else end
    if step != 1 or size is None or not isinstance(start, int) or not isinstance(end, int):
        return None

    def clamp(bound: int) -> int:
        return min(max(bound + size if bound < 0 else bound, 0), size)

    return dim % len(shape), clamp(start), clamp(end)


def _rewrite(gm: fx.GraphModule, blank: fx.Node, dim: int, copies: list[fx.Node],
             order: dict[fx.Node, int]) -> None:
    """Put cat(the copies' sources, dim) after the last copy in place of `blank`; erase the
    blank, its slices and the copies."""
    last = max(copies, key=order.__getitem__)
    aten = isinstance(blank.target, torch._ops.OpOverload)
    with gm.graph.inserting_after(last):
        cat = gm.graph.call_function(torch.ops.aten.cat.default if aten else torch.cat,
                                     ([copy.args[1] for copy in copies], dim))
    copy_meta(blank, cat, kind="view")
    for copy in copies:
        cut = copy.args[0]
        gm.graph.erase_node(copy)
        gm.graph.erase_node(cut)
    blank.replace_all_uses_with(cat)
    gm.graph.erase_node(blank)


def _dtype(node) -> torch.dtype | None:
    info = get_info(node) if isinstance(node, fx.Node) else None
    return info.dtypes[0] if info is not None and len(info.dtypes) == 1 else None
