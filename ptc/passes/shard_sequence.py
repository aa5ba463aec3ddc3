"""The shard_sequence pass: split the activations outside tp regions along the sequence.

Between tensor-parallel regions (norms, residual adds, dropout) every tp
rank holds the same full activation. Sequence parallelism (Korthikanti et
al. 2022) gives each rank 1/tp of the sequence there instead, with the same
communication volume: the pass turns each `copy_to_tp` in front of a
column-parallel region into `all_gather_seq`, and each `reduce_from_tp`
after a row-parallel one (and the vocabulary-parallel embedding) into
`reduce_scatter_seq`. A replicated tensor that meets the split sequence
(learned positions added to the token embedding) enters through
`scatter_seq`. An op outside the tp regions that mixes positions (an
attention whose projections a `shard ... replicate` rule keeps whole, a
convolution along the sequence) gets its split inputs whole through
`gather_seq` and runs whole, alike on every rank, until its output meets
the split sequence again (`scatter_seq`). So does a mixture-of-experts
block, whose rows are reordered by expert (`_experts_whole`): its input
gathered whole, its router and its experts (split over tp, their
all-reduces kept) run on every token, its output scattered back. Sizes the model reads off its
tensors are folded to the whole sequence first, so that a table sliced to
the sequence length (rotary angles) spans all of it and enters the split
through `scatter_seq`, not as the first rank's rows on every rank.
Parameters used on the split sequence (norm weights, the
row-parallel biases) see only part of the tokens on each rank: the pass
lists them in the tensor-parallel layout (`partial_grads`) and the
runtime sums their gradients over tp once per step, in one collective
(as Megatron-LM does), rather than once per use and micro-batch.

The sequence dim is dim 1 of the [b, s, ...] activations at the region
boundaries; shape arguments inside (a sequence length read off a split
tensor, `view(b, s, ...)`) are rewritten by `ptc.passes.local_shapes`.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import fx

from ptc.compiler.records.decisions import Decisions
from ptc.compiler.graph.meta import (copy_meta, get_info, graph_info, graph_record,
                                     update_graph_record)
from ptc.compiler.graph.moe_structure import find_expert_blocks
from ptc.compiler.graph.nodes import (CROSS_ENTROPY_OPS, logits_linear, module_of, op_name,
                                      params_behind, walk, where)
from ptc.errors import CompileError
from ptc.ops.tp_ops import (all_gather_seq, copy_to_tp, gather_seq, reduce_from_tp,
                            reduce_scatter_seq, scatter_seq)
from ptc.passes.functional import functionalize
from ptc.passes.local_shapes import Propagation, fold_sizes, is_shape_only, propagate

log = logging.getLogger("ptc.passes.shard_sequence")

SEQ_DIM = 1
"""The sequence dim of [b, s, ...] activations."""
_FREE = dict(flops=0, params=0, param_bytes=0)


def _resized(x: torch.Tensor, dim: int, factor: float) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = int(shape[dim] * factor)
    return x.new_empty(shape)


def _rules():
    """Meta stand-ins: on one process the sequence collectives cannot change shapes."""
    return {
        all_gather_seq: lambda k_, x, dim=SEQ_DIM, axis="tp": _resized(x, dim, k_),
        reduce_scatter_seq: lambda k_, x, dim=SEQ_DIM, axis="tp": _resized(x, dim, 1 / k_),
        scatter_seq: lambda k_, x, dim=SEQ_DIM, axis="tp": _resized(x, dim, 1 / k_),
        gather_seq: lambda k_, x, dim=SEQ_DIM, axis="tp": _resized(x, dim, k_),
    }


def shard_sequence_pass(gm: fx.GraphModule, decisions: Decisions) -> fx.GraphModule:
    """Replace tp all-reduces by reduce-scatter / all-gather along the sequence.

    Norm, residual and dropout activations then take 1/tp of the memory on
    each rank, at no extra communication. Runs when
    `parallel.sequence_parallel` is set and tp > 1, after the
    tensor_parallel pass.
    """
    plan = decisions.plan
    tp = plan.parallel.tp
    if not plan.parallel.sequence_parallel or tp == 1:
        return gm
    tp_layout = graph_record(gm).tensor_parallel
    if tp_layout is None:
        raise CompileError("sequence_parallel: run the tensor_parallel pass first")
    capture = graph_info(gm)
    seq_len = capture.seq_len // plan.parallel.cp  # what a cp rank holds of the sequence
    if seq_len % tp:
        raise CompileError(f"sequence parallelism: the {seq_len} positions a rank holds are "
                           f"not divisible by tp = {tp}")
    fold_sizes(gm)  # a table sliced to the sequence length spans the whole sequence
    counts = {"all_gather_seq": 0, "reduce_scatter_seq": 0, "scatter_seq": 0, "gather_seq": 0}
    kept = _experts_whole(gm, capture.micro_batch, seq_len, counts)
    split = _split_activations(gm, kept)
    for node in list(gm.graph.nodes):
        if node in kept:
            continue
        if node.target is copy_to_tp and node.args[0] in split:
            _swap(gm, node, all_gather_seq, capture.micro_batch, seq_len)
            counts["all_gather_seq"] += 1
        elif node.target is reduce_from_tp:
            _swap(gm, node, reduce_scatter_seq, capture.micro_batch, seq_len)
            counts["reduce_scatter_seq"] += 1

    def insert(op, user: fx.Node, x: fx.Node, dim: int) -> fx.Node:
        with gm.graph.inserting_before(user):
            node = gm.graph.call_function(op, (x, dim))
        copy_meta(x, node, kind="other", **_FREE)
        counts[op.__name__] += 1
        return node

    for head in _whole_heads(gm, split):  # a head kept whole reads the whole sequence
        x = head.args[0]
        head.replace_input_with(x, insert(gather_seq, head, x, SEQ_DIM))

    prop = propagate(gm, k=tp, prefer=frozenset({seq_len}), pick_last=True,
                     rules=_rules(), on_mix=lambda *a: insert(scatter_seq, *a),
                     on_gather=lambda *a: insert(gather_seq, *a),
                     what="sequence parallelism", axes={"cp": plan.parallel.cp})
    region = _region(gm, prop)
    partial = _sequence_params(gm, region)
    partial = tuple(dict.fromkeys(tp_layout.partial_grads + partial))  # with the tp pass's
    update_graph_record(gm, tensor_parallel=dataclasses.replace(tp_layout, partial_grads=partial))
    gm.graph.lint()
    gm.recompile()
    log.info("inserted %d all_gather_seq, %d reduce_scatter_seq, %d scatter_seq (replacing tp "
             "all-reduces), %d gather_seq; %d parameters of the split sequence get their "
             "gradients summed over tp once per step", counts["all_gather_seq"],
             counts["reduce_scatter_seq"], counts["scatter_seq"], counts["gather_seq"],
             len(partial))
    return gm


def _experts_whole(gm: fx.GraphModule, b: int, s: int, counts: dict[str, int]) -> set[fx.Node]:
    """Run each mixture-of-experts block on the whole sequence: its input gathered
    (`gather_seq`), its output scattered back (`scatter_seq`); return the tp collectives
    inside, which stay all-reduces.

    A block routes token rows reordered by expert (`ptc.compiler.graph.moe_structure`):
    between its router and its weighted sum over the top-k there is no sequence dim to
    split. So the [b, s, h] tensor its rows are gathered from is gathered whole where the
    block reads it, and the first [b, s, ...] tensor after its experts' output is cut back
    to the rank's chunk. Everything between — router, experts (split over tp as ever), a
    shared expert — runs on every token, alike on every tp rank.
    """
    try:
        blocks = find_expert_blocks(gm)
    except CompileError:
        return set()  # not followed: `_swap` refuses its collectives in one line
    kept: set[fx.Node] = set()
    for block in blocks:
        source, out = _block_input(block.rows, b, s), _block_output(block.output, b, s)
        if source is None or out is None:
            continue  # `_swap` refuses the block's collectives
        inside = set(walk([source], lambda n: n.users)) & \
            set(walk([out], lambda n: n.all_input_nodes))
        with gm.graph.inserting_after(source):
            whole = gm.graph.call_function(gather_seq, (source, SEQ_DIM))
        copy_meta(source, whole, kind="other", **_FREE)
        for user in [u for u in source.users if u in inside]:
            user.replace_input_with(source, whole)
        with gm.graph.inserting_after(out):
            mine = gm.graph.call_function(scatter_seq, (out, SEQ_DIM))
        copy_meta(out, mine, kind="other", **_FREE)
        out.replace_all_uses_with(mine, delete_user_cb=lambda user: user is not mine)
        counts["gather_seq"] += 1
        counts["scatter_seq"] += 1
        kept |= {n for n in inside if n.target in (copy_to_tp, reduce_from_tp)}
    return kept


def _block_input(rows: fx.Node, b: int, s: int) -> fx.Node | None:
    """The [b, s, ...] activation a block's routed rows are taken from: back from the rows
    through casts, row gathers and reshapes (None when there is none)."""
    node = rows
    for _ in range(12):
        shape = (get_info(node).shapes or ((),))[0] if get_info(node) else ()
        if tuple(shape[:2]) == (b, s):
            return node
        if not node.all_input_nodes:
            return None
        node = node.args[0] if isinstance(node.args[0], fx.Node) else None
        if node is None:
            return None
    return None


def _block_output(output: fx.Node, b: int, s: int) -> fx.Node | None:
    """The first [b, s, ...] tensor after a block's experts' output, along single users."""
    node = output
    for _ in range(16):
        if len(node.users) != 1:
            return None
        node = next(iter(node.users))
        shape = (get_info(node).shapes or ((),))[0] if get_info(node) else ()
        if tuple(shape[:2]) == (b, s):
            return node
    return None


def _split_activations(gm: fx.GraphModule, kept: set[fx.Node]) -> set[fx.Node]:
    """The nodes that will hold 1/tp of the sequence: those a reduce_from_tp (to become a
    reduce-scatter; not one `kept` inside a block run whole) reaches without entering a tp
    region (a copy_to_tp).

    A tp region entered from anything else (a replicated embedding's output, a
    parameter) keeps its copy_to_tp: its input is whole on every rank, and the
    sequence splits only where it meets split activations (`scatter_seq`).
    """
    split: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.target is reduce_from_tp and node not in kept:
            split.add(node)
        elif node.target is not copy_to_tp and any(a in split for a in node.all_input_nodes):
            split.add(node)
    return split


def _whole_heads(gm: fx.GraphModule, split: set[fx.Node]) -> list[fx.Node]:
    """The linears a loss of torch's own (not tp's vocabulary-parallel one: the head is
    kept whole) takes its logits from, reading the split sequence. The logits must cover
    the whole sequence, in the targets' order: the head's input is gathered, and head and
    loss run whole, alike on every rank."""
    heads = (logits_linear(n) for n in gm.graph.nodes if op_name(n) in CROSS_ENTROPY_OPS)
    return [head for head in heads if head is not None and head.args[0] in split]


def _swap(gm: fx.GraphModule, node: fx.Node, op, b: int, s: int) -> None:
    """Replace a tp collective node by the sequence op `op` along the sequence dim; a
    tensor of another layout with a sequence dim (`_as_sequence`) moves viewed as one."""
    x = node.args[0]
    shape = tuple(get_info(x).shapes[0])
    moved = _as_sequence(shape, b, s)
    if moved is None:
        raise CompileError(f"sequence parallelism: {where(node)} moves a tensor of shape {shape}, "
                           f"not [b={b}, s={s}, ...], [b·s, ...] or [b, 1, s, ...], so the "
                           "sequence dim cannot be found (a mixture-of-experts block routes its "
                           "tokens reordered); turn sequence_parallel off or shard \"...\" "
                           "replicate the linears there")
    with gm.graph.inserting_before(node):
        if moved != shape:
            x = gm.graph.call_method("view", (x, *moved))
            copy_meta(node, x, kind="view", shapes=(moved,), **_FREE)
        new = gm.graph.call_function(op, (x, SEQ_DIM))
        copy_meta(node, new, shapes=get_info(x).shapes)
        if moved != shape:
            new = gm.graph.call_method("view", (new, *shape))
            copy_meta(node, new, kind="view", shapes=(shape,), **_FREE)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def _as_sequence(shape: tuple[int, ...], b: int, s: int) -> tuple[int, ...] | None:
    """The [b, s, ...] shape a tensor of `shape` moves along the sequence as: its own, its
    flattened token rows [b·s, ...] unfolded (OPT's MLP), or [b, 1, s, ...] without the
    unit dims (DeepSeek's latent viewed as one head); None when it has no sequence dim."""
    if shape and shape[0] == b * s and s > 1:
        return (b, s, *shape[1:])
    if shape[:2] == (b, s):
        return shape
    unit = next((d for d in range(1, len(shape)) if shape[d] != 1), len(shape))
    if shape[:1] == (b,) and unit < len(shape) and shape[unit] == s:
        return (b, s, *shape[unit + 1:])
    return None


def _region(gm: fx.GraphModule, prop: Propagation) -> set[fx.Node]:
    """Nodes whose output is split along the sequence; check each keeps the split."""
    ordered = [n for n in gm.graph.nodes if prop.is_split(n)]
    region = set(ordered)
    for node in ordered:  # graph order: the first offending node is the one named
        for user in node.users:
            if user.op == "output":
                raise CompileError(f"sequence parallelism: {where(node)} reaches the graph "
                                   "output split along the sequence")
            if user not in region and not is_shape_only(user) and \
                    user.target not in (all_gather_seq, gather_seq):
                raise CompileError(f"sequence parallelism: {where(user)} turns a tensor split "
                                   f"along the sequence into one that is not ({node.name}: "
                                   f"{prop.local[node]}); it reduces over the sequence")
    return region


def _sequence_params(gm: fx.GraphModule, region: set[fx.Node]) -> tuple[str, ...]:
    """Names of the parameters nodes on the split sequence read, in graph order.

    Modules with parameters there become functional calls reading get_attr
    nodes, so every such parameter is a named input the runtime can find.
    """
    for node in list(gm.graph.nodes):
        if node in region and node.op == "call_module" and \
                any(True for _ in module_of(node).parameters()):
            region.discard(node)
            region.add(functionalize(gm, node))
    names: dict[str, None] = {}  # ordered set
    behind = params_behind(gm)  # through what is computed from them alone (Gemma's 1 + w)
    for node in gm.graph.nodes:
        if node in region:
            names.update(dict.fromkeys(name for arg in node.all_input_nodes
                                       for name in behind.get(arg, ())))
    return tuple(names)
