"""The split_context pass: give each cp rank two chunks of every sample's sequence.

Context parallelism (`parallel.cp`) splits the sequence of every sample
over the cp ranks: rank r holds chunks r and 2·cp−1−r of 2·cp (balanced
causal attention work, `ptc.ops.positions`). The pass rewrites the
captured graph into the graph every cp rank runs:

- sizes the model reads off its tensors become the constants they were
  at capture, so that a position table or `arange` built from the
  sequence length still spans the whole sequence;
- the batch's tokens and targets enter through `context_chunks`, and so
  does every other tensor of the whole sequence that meets the split
  activations (learned positions, rotary tables);
- each causal attention becomes `context_attention`, which all-gathers the
  keys and values over cp (and reduce-scatters their gradients): fused
  scaled_dot_product_attention with is_causal and no mask (capture turns
  one handed exactly the causal mask into it, `ptc.compiler.capture.causal_kernel`),
  or the written out form scores → causal masked_fill → softmax → dropout → @ values;
- dropout sites on split activations keep their part of each sample's mask.

Everything else is local to a position, or made so:
- token rows flattened [b·s, ...] and grouped by expert (a sort of the
  rows' expert ids, gathers in that order, per-expert counts as the offsets
  of grouped products, the rows put back: `grouped_rows`) are each rank's
  own rows, grouped on the rank;
- a sum or mean over the sequence (a load-balancing loss's share of tokens
  per expert, a count by histc) is the rank's over its positions, then
  summed over cp by `context_reduce`, whose backward sums the gradient too.

The loss is the mean over the rank's tokens; the runtime averages gradients
over dp·cp, which makes them the global-batch mean's. An attention that is
not causal self-attention (a padding mask, a bias, cross-attention), a
softmax, cumulative op or other reduction over the sequence, or a loss that
is not the mean over tokens is refused: ptc would otherwise train something
else.
"""

from __future__ import annotations

import logging

from torch import fx

from ptc.compiler.records.decisions import Decisions
from ptc.compiler.graph.meta import copy_meta, graph_info
from ptc.compiler.graph.nodes import (LOSS_OPS, attention_parts, has_effect, mixes_along, op_name,
                                      where)
from ptc.errors import CompileError
from ptc.ops.context import context_attention, context_chunks, context_reduce
from ptc.ops.dropout import site_dropout
from ptc.passes.grouped_rows import COUNT_OPS, groups_rows, invert_permutations, row_groupings
from ptc.passes.local_shapes import (Propagation, fold_sizes, is_shape_only, propagate,
                                     shape_of)

log = logging.getLogger("ptc.passes.split_context")

SEQ_DIM = 1
"""The sequence dim of the [b, s] tokens and targets."""
_FREE = dict(flops=0, params=0, param_bytes=0)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")
_TRANSPOSES = frozenset({"transpose", "permute", "t"})
_SCALES = frozenset({"mul", "truediv", "div"})
_MASK_FILLS = frozenset({"masked_fill", "masked_fill_"})
def split_context_pass(gm: fx.GraphModule, decisions: Decisions) -> fx.GraphModule:
    """Split every sample's sequence over cp and gather keys and values at each attention.

    Runs first, on the whole captured graph, when `parallel.cp` > 1; the
    tensor_parallel pass then splits the cp-local graph by heads.
    """
    cp = decisions.plan.parallel.cp
    if cp == 1:
        return gm
    capture = graph_info(gm)
    if not capture.with_loss:
        raise CompileError("context parallelism needs a graph that computes its loss")
    folded = fold_sizes(gm)
    attentions = [node for node in list(gm.graph.nodes) if attention_parts(node) is not None]
    if not attentions:
        raise CompileError("context parallelism: the model has no attention ptc can find")
    for node in attentions:
        _gather_keys(gm, node)
    gm.graph.eliminate_dead_code(is_impure_node=has_effect)
    entered = _enter_inputs(gm, capture.micro_batch, capture.seq_len)
    inverted = invert_permutations(gm)
    mixes = 0

    def enter(user: fx.Node, whole: fx.Node, dim: int) -> fx.Node:
        nonlocal mixes
        with gm.graph.inserting_before(user):
            node = gm.graph.call_function(context_chunks, (whole, dim))
        copy_meta(whole, node, kind="other", **_FREE)
        mixes += 1
        return node

    prop = propagate(gm, k=cp, prefer=frozenset({capture.seq_len}), on_mix=enter,
                     what="context parallelism", axes={"cp": cp})
    reduced = _check_region(gm, prop)
    sites = _key_dropout_sites(gm, prop)
    gm.graph.lint()
    gm.recompile()
    log.info("folded %d sizes; %d context_attention, %d inputs and %d whole-sequence tensors "
             "enter through context_chunks; %d dropout sites keep their chunks of the mask; "
             "%d sums over the sequence made whole by context_reduce; %d inverse orders of "
             "rows grouped by expert written as argsort",
             folded, len(attentions), entered, mixes, sites, reduced, inverted)
    return gm


# ------------------------------------------------------------------ attention


def _gather_keys(gm: fx.GraphModule, out: fx.Node) -> None:
    """Replace the attention ending at `out` by context_attention, or refuse it."""
    parts = attention_parts(out)
    if parts.fused:
        kwargs = _fused_kwargs(out)
    else:
        kwargs = _written_kwargs(out, parts)
    q, k, v = kwargs.pop("query"), kwargs.pop("key"), kwargs.pop("value")
    with gm.graph.inserting_before(out):
        new = gm.graph.call_function(context_attention, (q, k, v), kwargs)
    copy_meta(out, new)
    out.replace_all_uses_with(new)
    gm.graph.erase_node(out)


def _fused_kwargs(node: fx.Node) -> dict:
    """context_attention's arguments for a scaled_dot_product_attention / site_attention."""
    if op_name(node) not in ("scaled_dot_product_attention", "site_attention"):
        raise CompileError(f"context parallelism: {where(node)} is an attention kernel ptc "
                           "does not split over cp; call F.scaled_dot_product_attention")
    call = dict(zip(_SDPA_ARGS, node.args)) | dict(node.kwargs)
    if not call.get("is_causal", False) or call.get("attn_mask") is not None:
        raise CompileError(f"context parallelism: {where(node)} is not causal attention (is_causal"
                           "=True without a mask, or a mask computed from constants alone that "
                           "is the causal one: no padding, no bias, no window); cp splits only "
                           "causal self-attention")
    return dict(query=call["query"], key=call["key"], value=call["value"],
                scale=call.get("scale"), dropout_p=call.get("dropout_p", 0.0),
                enable_gqa=call.get("enable_gqa", False), site=call.get("site"),
                full=call.get("full"), fused=True)


def _written_kwargs(out: fx.Node, parts) -> dict:
    """context_attention's arguments for scores → causal mask → softmax → dropout → @ values,
    checking that the chain is exactly that."""
    def refuse(why: str) -> CompileError:
        return CompileError(f"context parallelism: the attention at {where(out)} {why}; cp "
                            "splits causal self-attention written as softmax(q @ kᵀ · scale "
                            "masked causally) @ v, or F.scaled_dot_product_attention")

    if parts.sinks is not None:
        raise refuse("joins per-head sink logits to its scores (attention sinks)")
    probs = out.args[0]
    dropout = None
    if op_name(probs) == "site_dropout":
        dropout, probs = probs, probs.args[0]
    if op_name(probs) != "softmax" or _softmax_dim(probs) not in (-1, 3):
        raise refuse("does not take a softmax over the keys")
    masked = probs.args[0]
    if op_name(masked) not in _MASK_FILLS or not _is_causal_mask(masked.args[1]) or \
            masked.args[2] != float("-inf"):
        raise refuse("has no causal mask (masked_fill of triu(ones, 1) with -inf)")
    scores, scale = masked.args[0], None
    if op_name(scores) in _SCALES and isinstance(scores.args[1], (int, float)):
        scale = scores.args[1] if op_name(scores) == "mul" else 1.0 / scores.args[1]
        scores = scores.args[0]
    if op_name(scores) not in ("matmul", "bmm") or scores.args[:2] != (parts.q, parts.k):
        raise refuse("computes its scores other than by q @ kᵀ")
    key_t = parts.k
    if op_name(key_t) not in _TRANSPOSES or not _swaps_last_two(key_t):
        raise refuse("does not multiply by the transposed keys")
    for node in (scores, masked, probs, *(() if dropout is None else (dropout,))):
        if len(node.users) != 1:
            raise refuse(f"uses {node.name} elsewhere too")
    if scale is None:
        scale = 1.0
    kwargs = dict(query=parts.q, key=key_t.args[0], value=parts.v, scale=scale, fused=False)
    if dropout is not None:
        _, p, train, site, full = dropout.args[:5]
        if train and p:
            kwargs.update(dropout_p=p, site=site, full=full)
    return kwargs


def _softmax_dim(node: fx.Node):
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")


def _swaps_last_two(node: fx.Node) -> bool:
    name, args = op_name(node), node.args[1:]
    if name == "t":
        return True
    if name == "transpose":
        return {a % 4 for a in args} == {2, 3}
    return len(args) == 4 and list(args) == [0, 1, 3, 2] or \
        len(args) == 1 and list(args[0]) == [0, 1, 3, 2]


def _is_causal_mask(mask) -> bool:
    """Whether `mask` is triu(ones(..), diagonal=1): True above the diagonal."""
    if not isinstance(mask, fx.Node) or op_name(mask) != "triu":
        return False
    diagonal = mask.args[1] if len(mask.args) > 1 else mask.kwargs.get("diagonal", 0)
    source = mask.args[0]
    return diagonal == 1 and op_name(source) in ("ones_like", "ones")


# ------------------------------------------------------------ the split region


def _enter_inputs(gm: fx.GraphModule, micro_batch: int, seq_len: int) -> int:
    """Put context_chunks between each [b, s] input and its users; how many inputs."""
    entered = 0
    for node in list(gm.graph.nodes):
        shape = shape_of(node) if node.op == "placeholder" else None
        if shape is None or len(shape) < 2 or shape[:2] != (micro_batch, seq_len) \
                or not node.users:
            continue
        first = min(node.users, key=_position(gm))
        with gm.graph.inserting_before(first):
            part = gm.graph.call_function(context_chunks, (node, SEQ_DIM))
        copy_meta(node, part, kind="other", **_FREE)
        node.replace_all_uses_with(part, delete_user_cb=lambda user: user is not part)
        entered += 1
    return entered


def _position(gm: fx.GraphModule):
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    return order.__getitem__


def _check_region(gm: fx.GraphModule, prop: Propagation) -> int:
    """Refuse ops that would mix positions of the split sequence: a softmax over it, a
    cumulative sum, sort, roll or convolution along it, or a reduction of it other than
    the loss's mean over tokens and a sum or mean (made whole by `context_reduce`). Rows
    grouped by expert (`grouped_rows`) pass. Returns how many reductions were made whole."""
    groups = row_groupings(gm, prop)
    reduced: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        if not prop.is_split(node):
            continue
        for user in list(node.users):
            if user.op == "output":
                raise CompileError(f"context parallelism: {where(node)} reaches the graph "
                                   "output split along the sequence")
            if groups_rows(user, groups) or user in reduced:
                continue
            dim = _split_dim(prop, node)
            if mixes_along(user, node, dim):
                raise CompileError(f"context parallelism: {where(user)} mixes positions along "
                                   "the sequence, which is split over cp (each rank would see "
                                   "only its chunks); cp splits models whose only mixing of "
                                   "positions is causal attention, sums and means over the "
                                   "sequence and the grouping of token rows by expert")
            if prop.is_split(user) or is_shape_only(user) or user.target is context_attention:
                continue
            if op_name(user) in LOSS_OPS and _mean_loss(user):
                continue
            how = _reduction(user, node, dim)
            if how is None:
                raise CompileError(f"context parallelism: {where(user)} turns a tensor split "
                                   f"along the sequence into one that is not ({node.name}: "
                                   f"{prop.local[node]}); it reduces over the sequence other "
                                   "than by a sum or mean, which cp cannot make whole")
            _reduce_whole(gm, user, mean=how == "mean")
            reduced.add(user)
    return len(reduced)


def _reduction(node: fx.Node, x: fx.Node, dim: int) -> str | None:
    """"sum" or "mean" when `node` sums or averages its input `x` over (among others) the
    split `dim`, or counts its values (histc, bincount: a sum); else None."""
    name = op_name(node)
    if name in COUNT_OPS:
        return "sum"
    if name not in ("sum", "mean") or node.args[:1] != (x,):
        return None
    dims = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    if dims is None or dims == []:  # over every element
        return name
    rank = len(shape_of(x) or ())
    listed = dims if isinstance(dims, (list, tuple)) else (dims,)
    return name if rank and dim in {d % rank for d in listed} else None


def _reduce_whole(gm: fx.GraphModule, node: fx.Node, *, mean: bool) -> None:
    """Make the rank's sum or mean over its positions the whole sequence's: every later
    use of `node` reads it through `context_reduce`."""
    with gm.graph.inserting_after(node):
        whole = gm.graph.call_function(context_reduce, (node,), {"mean": mean})
    copy_meta(node, whole, kind="other", **_FREE)
    node.replace_all_uses_with(whole, delete_user_cb=lambda user: user is not whole)


def _mean_loss(node: fx.Node) -> bool:
    reduction = node.kwargs.get("reduction", "mean")
    return reduction == "mean" and node.kwargs.get("weight") is None


def _split_dim(prop: Propagation, node: fx.Node) -> int:
    before, local = prop.before[node][0], prop.local[node][0]
    return next(d for d in range(len(local)) if before[d] != local[d])


def _key_dropout_sites(gm: fx.GraphModule, prop: Propagation) -> int:
    """Tell each dropout site on split activations that its sequence dim is cp-chunked."""
    count = 0
    for node in gm.graph.nodes:
        if node.target is not site_dropout or not prop.is_split(node.args[0]):
            continue
        args = list(node.args) + [None] * (6 - len(node.args))
        args[5] = ((_split_dim(prop, node.args[0]), "cp"),)
        node.args = tuple(args)
        count += 1
    return count
