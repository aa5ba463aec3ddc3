"""The expert_capacity pass: give each expert of a mixture-of-experts layer a capacity.

With `moe { capacity_factor = f }` (Megatron-LM's --moe-expert-capacity-factor)
every expert block of the graph (`ptc.compiler.graph.moe_structure`) gets,
before its first grouped product, `keep_within_capacity`: the indices of the
rows each expert computes within ceil(f · N / E) of the rank's N routed rows,
and the kept groups' offsets; the rows (and per-row inputs) are taken at those
indices, and after the last product `restore_dropped` puts the outputs back in
place, zeros for the dropped rows. Under `drop_policy = probs` the rows of the
lowest routing weight go: the weight of each row is the row-aligned factor the
block's output is multiplied by. Runs before the expert_parallel pass, whose
exchange then moves only the rows kept.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator

import torch
from torch import fx

from ptc.compiler.graph.meta import KEY, copy_meta, get_info
from ptc.compiler.graph.moe_structure import ExpertBlock, find_expert_blocks
from ptc.compiler.graph.nodes import TRANSPARENT_OPS, node_shape, op_name, where
from ptc.compiler.records.decisions import Decisions
from ptc.errors import CompileError
from ptc.ops.expert_capacity import keep_within_capacity, restore_dropped

log = logging.getLogger("ptc.passes.cap_experts")

_FREE = dict(flops=0, params=0, param_bytes=0)
_TO_WEIGHT = frozenset({"to", "add", "add_", "reduce_from_tp", "contiguous", "clone"})
"""Ops between a block's output and the product by its routing weights (casts, a bias,
the tp sum of partial outputs)."""


def cap_experts_pass(gm: fx.GraphModule, decisions: Decisions) -> fx.GraphModule:
    """Insert keep_within_capacity / restore_dropped around each layer's experts.

    Each expert then computes at most its capacity of the rows routed to it, as
    Megatron-LM's token dropping: bounded work and exchange per expert, at the
    cost of the dropped rows' contributions. Runs when `moe.capacity_factor` is
    set; raises CompileError when the model has no routed experts or, under
    drop_policy = probs, when the routing weight of each row cannot be found.
    """
    moe = decisions.plan.moe
    if moe.capacity_factor is None:
        return gm
    blocks = find_expert_blocks(gm)
    if not blocks:
        raise CompileError(f"moe.capacity_factor = {moe.capacity_factor}, but the model has no "
                           "routed experts (no grouped product of token rows with a stack of "
                           "expert weights)")
    for block in blocks:
        weights = _routing_weights(block) if moe.drop_policy == "probs" else None
        _cap(gm, block, weights, moe.capacity_factor, moe.drop_policy)
    gm.graph.lint()
    gm.recompile()
    log.info("inserted %d keep_within_capacity (capacity factor %g, drop policy %s)",
             len(blocks), moe.capacity_factor, moe.drop_policy)
    return gm


def _routing_weights(block: ExpertBlock) -> fx.Node:
    """The row-aligned factor the block's output is multiplied by: each row's routing
    weight (through casts, a bias added, the tp sum)."""
    rows = (node_shape(block.rows) or (None,))[0]
    node = block.output
    for _ in range(8):
        if len(node.users) != 1:
            break
        user = next(iter(node.users))
        if op_name(user) == "mul":
            other = next((a for a in user.all_input_nodes if a is not node), None)
            if other is not None and (node_shape(other) or (None,))[0] == rows:
                return other
            break
        if op_name(user) not in _TO_WEIGHT:
            break
        node = user
    raise CompileError(f"moe.drop_policy = probs: the routing weight of each row of the "
                       f"experts ending at {where(block.output)} cannot be found (no product of "
                       f"their output with one weight per row); use drop_policy = position")


def _hoist(node: fx.Node, before: fx.Node) -> None:
    """Move `node`, and what it is computed from, before `before` where it comes after it:
    reshapes and casts of a tensor that is ready sooner (the routing weights' unsqueeze)."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    if order[node] < order[before]:
        return
    if node.op != "call_function" and node.op != "call_method" or \
            op_name(node) not in TRANSPARENT_OPS | {"getitem"}:
        raise CompileError(f"moe.capacity_factor: the routing weights {where(node)} are "
                           "computed after the experts' first grouped product, by more than "
                           "a reshape; use drop_policy = position")
    for source in node.all_input_nodes:
        _hoist(source, before)
    before.prepend(node)


def _cap(gm: fx.GraphModule, block: ExpertBlock, weights: fx.Node | None, factor: float,
         policy: str) -> None:
    """Keep each expert's rows within capacity before the block, restore after it."""
    graph, first, last = gm.graph, block.products[0], block.output
    if weights is not None:  # the product by the weights comes late; the weights are ready
        _hoist(weights, first)
    order = {node: i for i, node in enumerate(graph.nodes)}
    late = [n for n in (block.rows, block.offsets, *block.row_inputs, *([weights] if weights
                                                                         else []))
            if order[n] > order[first]]
    if late:
        raise CompileError(f"moe.capacity_factor: {late[0].name} is computed after the experts' "
                           f"first grouped product {first.name}; their capacity cannot be "
                           "applied before them")
    with graph.inserting_before(first):
        keep = graph.call_function(keep_within_capacity, (block.rows, block.offsets, weights,
                                                          factor, policy))
        kept = graph.call_function(operator.getitem, (keep, 0))
        offsets = graph.call_function(operator.getitem, (keep, 1))
        taken = {source: graph.call_function(torch.ops.aten.index_select.default,
                                             (source, 0, kept))
                 for source in (block.rows, *block.row_inputs)}
    # Shapes as at most every expert full: min(N, E · ceil(f · N / E)) rows.
    rows = get_info(block.rows).shapes[0][0]
    left = min(rows, math.ceil(factor * rows / block.experts) * block.experts)
    copy_meta(first, keep, kind="other", **_FREE, shapes=(), dtypes=())
    copy_meta(first, kept, kind="view", **_FREE, shapes=((left,),), dtypes=(torch.int64,))
    copy_meta(first, offsets, kind="view", **_FREE, shapes=get_info(block.offsets).shapes,
              dtypes=get_info(block.offsets).dtypes)
    for source, node in taken.items():
        shape = get_info(source).shapes[0]
        copy_meta(first, node, kind="view", **_FREE, shapes=((left, *shape[1:]),),
                  dtypes=get_info(source).dtypes)
    swaps = {block.offsets: offsets, **taken}
    out_shapes = get_info(last).shapes
    for node in block.body:
        for old, new in swaps.items():
            if old in node.all_input_nodes:
                node.replace_input_with(old, new)
        info = get_info(node)
        node.meta[KEY] = dataclasses.replace(info, shapes=tuple(
            (left, *s[1:]) if s and s[0] == rows else s for s in info.shapes))
    with graph.inserting_after(last):
        restored = graph.call_function(restore_dropped, (last, kept, block.rows))
    copy_meta(last, restored, kind="other", **_FREE, shapes=out_shapes)
    last.replace_all_uses_with(restored, delete_user_cb=lambda user: user is not restored)
