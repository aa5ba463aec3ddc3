"""Number the dropout calls of a captured graph and make their masks layout-independent.

Every dropout of the model — a Dropout module, `F.dropout`, the dropout
inside `scaled_dot_product_attention` — becomes a call of
`ptc.ops.dropout.site_dropout` / `site_attention` with its site number (its
place in forward order) and the shape of one sample's whole tensor, so that
the masks depend on the sample and the site alone (`ptc.ops.dropout`):
the same under every parallel layout as in eager training that numbers its
dropout calls the same way.

A dropout of flattened token rows [b·s, ...] (OPT's MLP) is applied to the
rows viewed as [b, s, ...], so its masks are the samples' too. One whose
tensor leads with neither keeps torch's dropout: it still trains, with masks
that depend on the layout.
"""

from __future__ import annotations

from torch import fx, nn

from ptc.compiler.graph.meta import copy_meta, get_info
from ptc.compiler.graph.nodes import module_of, op_name
from ptc.ops.dropout import site_attention, site_dropout


def number_dropout_sites(gm: fx.GraphModule, micro_batch: int, seq_len: int) -> int:
    """Replace every dropout of `gm` by its numbered site; returns how many sites it has."""
    site = 0
    for node in list(gm.graph.nodes):
        call = _dropout_call(node)
        if call is not None:
            x, p, train = call
            shape = get_info(node).shapes[0] if get_info(node) else ()
            if shape and shape[0] == micro_batch:
                _replace(gm, node, site_dropout, (x, p, train, site, tuple(shape[1:])))
            elif shape and shape[0] == micro_batch * seq_len and seq_len > 1:
                rows = _view(gm, node, x, (micro_batch, seq_len, *shape[1:]))
                new = _replace(gm, node, site_dropout, (rows, p, train, site,
                                                        (seq_len, *shape[1:])),
                               shapes=get_info(rows).shapes)
                flat = _view(gm, new, new, tuple(shape), after=True)
                new.replace_all_uses_with(flat, delete_user_cb=lambda user: user is not flat)
            site += 1
        elif _sdpa_dropout(node):
            q, k = node.args[0], node.args[1]
            qs, ks = get_info(q).shapes[0], get_info(k).shapes[0]
            if qs[0] == micro_batch:
                names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
                kwargs = dict(zip(names, node.args)) | dict(node.kwargs)
                kwargs |= {"site": site, "full": (qs[-3], qs[-2], ks[-2])}
                _replace(gm, node, site_attention, (), kwargs)
            site += 1
    if site:  # a graph without dropout is unchanged: its code stands
        gm.graph.lint()
        gm.recompile()
    return site


def _dropout_call(node: fx.Node):
    """(input, p, training) of a dropout node, or None."""
    if node.op == "call_module":
        module = module_of(node)
        if isinstance(module, nn.Dropout) and len(node.args) == 1 and not node.kwargs:
            return node.args[0], float(module.p), bool(module.training)
        return None
    if node.op != "call_function" or op_name(node) != "dropout":
        return None
    names = ("input", "p", "train") if "aten" in str(node.target) else ("input", "p", "training")
    args = dict(zip(names, node.args)) | dict(node.kwargs)
    if args.get("inplace"):
        return None
    return args["input"], float(args.get("p", 0.5)), bool(args.get(names[2], True))


def _sdpa_dropout(node: fx.Node) -> bool:
    if node.op != "call_function" or op_name(node) != "scaled_dot_product_attention":
        return False
    p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    return bool(p)


def _replace(gm: fx.GraphModule, node: fx.Node, fn, args: tuple, kwargs: dict | None = None,
             shapes: tuple | None = None) -> fx.Node:
    """`fn(*args, **kwargs)` in place of `node`, with its metadata (and `shapes`, when the
    new node's value has other shapes than `node`'s)."""
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(fn, args, kwargs or {})
    if shapes is None:
        copy_meta(node, new, same_value=True)
    else:
        copy_meta(node, new, shapes=shapes)
    node.replace_all_uses_with(new)
    name = node.name
    gm.graph.erase_node(node)
    new.name = name
    return new


def _view(gm: fx.GraphModule, near: fx.Node, x: fx.Node, shape: tuple[int, ...], *,
          after: bool = False) -> fx.Node:
    """`x.view(*shape)`, placed before `near` (after it with `after`), with its metadata."""
    with gm.graph.inserting_after(near) if after else gm.graph.inserting_before(near):
        view = gm.graph.call_method("view", (x, *shape))
    copy_meta(near, view, kind="view", shapes=(shape,), flops=0, params=0, param_bytes=0)
    return view
