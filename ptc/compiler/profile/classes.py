"""The tensor- and sequence-parallel classes of saved bytes: which tensors a tp rank holds
1/t of, which sequence parallelism splits, which stay whole, and the gathered copies
sequence parallelism keeps (module docstring of `ptc.compiler.profile.types`)."""

from __future__ import annotations

import copy
import math

import sympy
import torch
import torch.fx

from ptc.compiler.graph.flops import numel
from ptc.compiler.graph.meta import copy_meta, get_info, graph_info
from ptc.compiler.graph.nodes import (ATTENTION_OPS, CONVOLUTION_OPS, CROSS_ENTROPY_OPS,
                                      POINTWISE_OPS, is_embedding, is_linear, logits_linear,
                                      node_shape, op_name)
from ptc.compiler.graph.tp_structure import COLWISE, ROWWISE, VOCAB, Sharding
from ptc.compiler.profile.regions import node_regions
from ptc.compiler.profile.types import SAVED_CLASS_TERMS, SavedClasses, b


def saved_classes(fit: dict[str, sympy.Expr], region: str) -> SavedClasses:
    """Split measured tp/seq bytes into their batch terms and the batch-free `const`."""
    def split(name: str) -> tuple[sympy.Expr, sympy.Expr]:
        poly = fit[f"{region}.{name}"]
        free = poly.subs(b, 0)
        return sympy.expand(poly - free), free

    (tp, tp0), (seq, seq0) = split("tp"), split("seq")
    (ctp, ctp0), (cseq, cseq0) = split("core_tp"), split("core_seq")
    (kv, _), (ckv, _) = split("kv"), split("core_kv")  # their batch-free part is in `const`
    (whole, _), (cwhole, _) = split("whole"), split("core_whole")
    return SavedClasses(tp=tp, seq=seq, const=tp0 + seq0,
                        core_tp=ctp, core_seq=cseq, core_const=ctp0 + cseq0, kv=kv, core_kv=ckv,
                        whole=whole, core_whole=cwhole, split_const=fit[f"{region}.split_const"])


def linear_styles(gm: torch.fx.GraphModule, sharding: Sharding) -> dict[str, str]:
    """Node name -> tensor-parallel style of the linear or embedding it applies."""
    return {n.name: sharding.styles[path] for n in gm.graph.nodes
            if (path := is_linear(n) or is_embedding(n)) and path in sharding.styles}


def tp_sharded(gm: torch.fx.GraphModule, sharding: Sharding) -> set[str]:
    """Nodes whose output each tp rank holds 1/t of: from a column-parallel linear (or the
    vocabulary-parallel head) to the row-parallel linear that closes the block."""
    styles = linear_styles(gm, sharding)
    sharded: set[str] = set()
    for n in gm.graph.nodes:
        style = styles.get(n.name)
        if style == COLWISE or (style == VOCAB and is_linear(n)):
            sharded.add(n.name)
        elif style != ROWWISE and any(a.name in sharded for a in n.all_input_nodes):
            sharded.add(n.name)
    return sharded


def kv_nodes(gm: torch.fx.GraphModule, sharding: Sharding, sharded: set[str]) -> set[str]:
    """Nodes of the tp-sharded set computed from key/value projections alone: the linears
    and what works on k or v before the attention pairs them with the queries."""
    kv: set[str] = set()
    for n in gm.graph.nodes:
        if n.name not in sharded:
            continue
        inputs = {a.name for a in n.all_input_nodes if a.name in sharded}
        if is_linear(n) in sharding.kv_projections or (
                inputs and not is_linear(n) and inputs <= kv):
            kv.add(n.name)
    return kv


def whole_under_sp(gm: torch.fx.GraphModule, sharded: set[str]) -> set[str]:
    """Nodes outside the tp regions that sequence parallelism runs on the whole sequence,
    as `ptc.passes.shard_sequence` lowers them: an op that mixes positions (an attention,
    a product of two activations, a convolution) on activations a rule keeps whole, or a
    head kept whole whose logits reach the loss, gets them gathered, and what follows it
    stays whole until an elementwise op meets the split sequence again (the residual add,
    where the whole operand is scattered). Not modelled: an embedding kept whole, whose
    output runs whole into the first layer up to its first residual add."""
    data = _activations(gm)
    heads = {head.name for n in gm.graph.nodes if op_name(n) in CROSS_ENTROPY_OPS
             and (head := logits_linear(n)) is not None}
    whole: set[str] = set()
    for n in gm.graph.nodes:
        inputs = [a.name for a in n.all_input_nodes if a.name in data]
        if n.name not in data or n.name in sharded or not inputs:
            continue
        name = op_name(n)
        if n.target is gathered_copy:
            whole.add(n.name)
        elif any(a in whole for a in inputs):
            if name not in POINTWISE_OPS or all(a in whole or a in sharded for a in inputs):
                whole.add(n.name)
        elif name in ATTENTION_OPS or name in CONVOLUTION_OPS or n.name in heads or (
                name in _ACTIVATION_PRODUCTS and len(inputs) >= 2):
            whole.add(n.name)
    return whole


def gathered_copy(x: torch.Tensor) -> torch.Tensor:
    """Stand-in for sequence parallelism's `gather_seq` in the one-process profile: a new
    tensor laid out as its input, as the gather makes one (of the whole sequence)."""
    return x.clone(memory_format=torch.preserve_format)


def with_gathered_copies(gm: torch.fx.GraphModule, sharding: Sharding
                          ) -> torch.fx.GraphModule | None:
    """A copy of `gm` as sequence parallelism lowers what it runs whole: each split input of
    a node it runs whole (`whole_under_sp`) is read through a `gathered_copy` of its own,
    where the sequence_parallel pass inserts a `gather_seq` for that node. None when it
    runs nothing whole.

    Measured on it, a whole op's saved input is the gathered copy, a storage apart from
    the split tensor it came from: the two count separately where both are kept, and the
    recompute regions meet the copies where they meet the gathers.
    """
    sharded = tp_sharded(gm, sharding)
    whole, data = whole_under_sp(gm, sharded), _activations(gm)
    edges = [(n.name, a.name) for n in gm.graph.nodes if n.name in whole
             for a in n.all_input_nodes
             if a.name in data and a.name not in whole and a.name not in sharded
             and _output_bytes(a)]  # a tensor: not a size read off one
    if not edges:
        return None
    out = copy.deepcopy(gm)
    nodes = {n.name: n for n in out.graph.nodes}
    for user_name, input_name in edges:
        user, x = nodes[user_name], nodes[input_name]
        with out.graph.inserting_before(user):
            gathered = out.graph.call_function(gathered_copy, (x,))
        copy_meta(x, gathered, kind="other", flops=0, params=0, param_bytes=0)
        user.replace_input_with(x, gathered)
    out.recompile()
    return out


def is_saved_term(name: str) -> bool:
    """Whether a `measure_saved` term is saved bytes (a region's or a policy's class), not FLOPs,
    gathers or communication."""
    region, _, what = name.rpartition(".")
    return bool(region) and what in SAVED_CLASS_TERMS


_ACTIVATION_PRODUCTS = frozenset({"matmul", "bmm", "baddbmm", "einsum"})
"""Products that mix positions when both operands are activations (scores, probs @ v)."""


def _activations(gm: torch.fx.GraphModule) -> set[str]:
    """Nodes made from the graph's inputs (not tables built from sizes, not weights)."""
    data: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder" or (n.op != "output" and any(
                a.name in data for a in n.all_input_nodes)):
            data.add(n.name)
    return data


def sp_moves(gm: torch.fx.GraphModule, region: dict[str, str], sharded: set[str],
              whole: set[str]) -> dict[str, int]:
    """Bytes of layer 0 that sequence parallelism moves for what it runs whole: the split
    inputs it gathers ("sp.gathered") and the whole outputs it scatters back
    ("sp.scattered", gathered again as gradients in backward)."""
    gathered, scattered, data = set(), set(), _activations(gm)
    for n in gm.graph.nodes:
        if region.get(n.name) != "layer":
            continue
        inputs = [a for a in n.all_input_nodes if a.name in data]
        if n.name in whole:
            gathered.update(a for a in inputs if a.name not in whole and a.name not in sharded)
        elif n.name not in sharded:
            scattered.update(a for a in inputs if a.name in whole)
    return {"sp.gathered": sum(_output_bytes(a) for a in gathered),
            "sp.scattered": sum(_output_bytes(a) for a in scattered)}


def _output_bytes(node: torch.fx.Node) -> int:
    """Bytes of the node's (first) tensor output; 0 for a number (a size read off it)."""
    info = get_info(node)
    if info is None or not info.shapes or not info.dtypes:
        return 0
    return math.prod(info.shapes[0]) * info.dtypes[0].itemsize


def tp_regions(gm: torch.fx.GraphModule, sharding: Sharding, hidden: int
               ) -> tuple[float, float]:
    """(regions entered, regions left) in layer 0 as the tensor_parallel pass splits it, in
    layer boundaries (b·s·h elements) moved: the distinct inputs of its column-parallel
    linears (an all-reduce of each one's gradient) and the outputs of its row-parallel ones
    (an all-reduce each). Most move one boundary; routed experts' products move the top-k
    rows of every token (k boundaries), a low-rank projection's input less than one."""
    region = node_regions(gm)
    styles = linear_styles(gm, sharding)
    layer = [n for n in gm.graph.nodes if region[n.name] == "layer"]
    record = graph_info(gm)
    boundary = record.micro_batch * record.seq_len * hidden
    entries = {n.args[0] for n in layer if styles.get(n.name) == COLWISE and n.args}
    exits = [n for n in layer if styles.get(n.name) == ROWWISE]
    return (sum(numel(node_shape(x)) for x in entries) / boundary,
            sum(numel(node_shape(x)) for x in exits) / boundary)


def saved_whole(storage, whole: set[str]) -> bool:
    """Whether sequence parallelism keeps `storage` whole: made by a node it runs whole, or
    saved only by such nodes (which read it gathered)."""
    return storage.producer in whole or (
        bool(storage.savers) and all(x in whole for x in storage.savers))
