"""Fuse each tensor-parallel entry collective with the column-parallel linears that read it
(and, as collective matmuls, each exit with its row-parallel linear).

Terms: an *entry* is a `copy_to_tp` node, or with sequence parallelism an
`all_gather_seq` node, whose every user is a linear reading it as its input
(a `call_module` nn.Linear, or `F.linear` / `aten.linear` — what the
ZeRO-3 and checkpoint passes leave); those users are the entry's
*linears*: q, k and v (or one fused qkv), gate and up, the LM head.

Why: autograd runs the entry's backward — the all-reduce (reduce-scatter)
of dL/dx over tp — only after it has computed every linear's weight
gradient, so that communication is exposed. `column_parallel_linears`
(`column_parallel_linears_seq`) computes dL/dx first, starts its reduction
and computes the weight gradients while it runs, as Megatron-LM does.
Forward is unchanged, and so are the numerics but for the order in which
the linears' input gradients are summed.

With `parallel.tp_comm = async` the pass builds collective matmuls instead
(`ptc.ops.async_tp`): a sequence-parallel entry and its linears become one
`all_gather_linears`, and each *exit*, a `reduce_scatter_seq` whose input is
a bias-free row-parallel linear nothing else reads, becomes one
`linear_reduce_scatter` with it: the forward's collectives then run in ring
steps beside the GEMMs too.

Left alone: an entry any other node reads (the result would need the unfused output too); an
entry whose linears read a weight computed after the first of them (only
`get_attr` weight nodes can be moved up to the fused op).

`fuse_column_parallel_linears` works on the graph it is given, on every
stage of a pipeline graph, and on the activation-checkpoint regions
(the submodules `checkpoint_region` calls) of those, whose linears are inside them.
"""

from __future__ import annotations

import inspect
import logging
import operator
from dataclasses import dataclass

from torch import fx, nn

from ptc.compiler.graph.meta import copy_meta, get_info
from ptc.compiler.graph.nodes import module_of, op_name
from ptc.compiler.graph.stage_graphs import pipeline_stages
from ptc.passes.checkpoint_layers import checkpoint_regions
from ptc.passes.functional import param_node
from ptc.ops.async_tp import all_gather_linears, linear_reduce_scatter
from ptc.ops.async_tp_fp8 import all_gather_fp8_linears, fp8_linear_reduce_scatter
from ptc.ops.fp8_linear import fp8_linear
from ptc.ops.tp_ops import (all_gather_seq, column_parallel_linears,
                            column_parallel_linears_seq, copy_to_tp, reduce_scatter_seq)

log = logging.getLogger("ptc.passes.tp_overlap")

_FUSED = {copy_to_tp: column_parallel_linears, all_gather_seq: column_parallel_linears_seq}
_COLLECTIVE_MATMULS = {copy_to_tp: column_parallel_linears, all_gather_seq: all_gather_linears}
"""Entry -> fused op, with `tp_comm = async`: the all-gather taken apart beside the GEMMs."""


@dataclass(frozen=True, slots=True)
class _Linear:
    """A linear node and its operands: a weight or bias is a node, or a parameter name
    (a call_module Linear, whose parameters the fused op reads through new get_attr nodes)."""

    node: fx.Node
    x: fx.Node
    weight: fx.Node | str
    bias: fx.Node | str | None
    scaling: fx.Node | None = None
    """A float8 linear's `Fp8Scaling` node (`ptc.ops.fp8_linear`); None for others."""


def fuse_column_parallel_linears(gm: fx.GraphModule, *, collective_matmul: bool = False) -> int:
    """Replace each entry collective and its linears by one fused op call; return how many.

    Each entry becomes `column_parallel_linears(x, weights, biases, axis=...)`
    (or `column_parallel_linears_seq(x, weights, biases, dim=..., axis=...)`)
    placed where the first linear was, and each linear an `operator.getitem`
    of its output that keeps the linear's name and metadata, so backward
    overlaps the input gradient's reduction with the weight gradients.
    With `collective_matmul` (`parallel.tp_comm = async`) a sequence-parallel
    entry becomes `all_gather_linears` instead, and each row-parallel linear
    whose output only a `reduce_scatter_seq` reads becomes one
    `linear_reduce_scatter` (`ptc.ops.async_tp`): forward's collectives
    overlap the GEMMs too. Graphs it changed are linted and recompiled; the
    caller logs the count.
    """
    fused_ops = _COLLECTIVE_MATMULS if collective_matmul else _FUSED
    total = 0
    for graph in _graphs(gm):
        fused = sum(_fuse(graph, entry, linears, fused_ops)
                    for entry, linears in _entries(graph, fp8=collective_matmul))
        if collective_matmul:
            fused += sum(_fuse_exit(graph, exit_, linear) for exit_, linear in _exits(graph))
        if fused:
            graph.graph.lint()
            graph.recompile()
        total += fused
    return total


def _graphs(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The graphs holding linears: `gm` (or its pipeline stages) and their checkpoint regions."""
    out = []
    for graph in [stage for _, stage in pipeline_stages(gm)] or [gm]:
        out.append(graph)
        out.extend(checkpoint_regions(graph))
    return out


def _entries(gm: fx.GraphModule, *, fp8: bool) -> list[tuple[fx.Node, list[_Linear]]]:
    """Every entry of the graph with its linears, in graph order; entries of float8 linears
    (all of them float8) only with `fp8`."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _FUSED or not node.users:
            continue
        linears = [_linear(user) for user in node.users]
        kinds = {lin.scaling is None for lin in linears if lin is not None}
        if all(lin is not None and lin.x is node and node not in (lin.weight, lin.bias)
               for lin in linears) and (kinds == {True} or (
                   fp8 and kinds == {False} and node.target is all_gather_seq)):
            out.append((node, linears))
        else:
            log.debug("%s: read by other nodes than linears' inputs, not fused", node.name)
    return out


def _linear(node: fx.Node) -> _Linear | None:
    """`node` as a _Linear when it is a call_module nn.Linear or a functional linear."""
    if node.op == "call_module":
        module = module_of(node)
        if not isinstance(module, nn.Linear) or len(node.args) != 1 or node.kwargs:
            return None
        bias = f"{node.target}.bias" if module.bias is not None else None
        return _Linear(node, node.args[0], f"{node.target}.weight", bias)
    if node.op == "call_function" and node.target is fp8_linear:
        x, weight, bias, scaling = node.args
        return _Linear(node, x, weight, bias, scaling)
    if node.op != "call_function" or op_name(node) != "linear":
        return None
    args = dict(zip(("input", "weight", "bias"), node.args)) | dict(node.kwargs)
    if not isinstance(args.get("weight"), fx.Node):
        return None
    return _Linear(node, args.get("input"), args["weight"], args.get("bias"))


def _exits(gm: fx.GraphModule) -> list[tuple[fx.Node, _Linear]]:
    """Every `reduce_scatter_seq` of the graph whose input is a bias-free linear nothing else
    reads, with that linear, in graph order."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not reduce_scatter_seq:
            continue
        source = node.args[0]
        linear = _linear(source) if isinstance(source, fx.Node) else None
        if linear is not None and linear.bias is None and len(source.users) == 1 \
                and linear.x is not linear.weight:
            out.append((node, linear))
        else:
            log.debug("%s: not the only reader of a bias-free linear, not fused", node.name)
    return out


def _fuse_exit(gm: fx.GraphModule, exit_: fx.Node, linear: _Linear) -> int:
    """Put `linear_reduce_scatter` in place of `exit_` and its linear; 1 when done."""
    bound = inspect.signature(reduce_scatter_seq).bind(*exit_.args, **exit_.kwargs)
    bound.apply_defaults()
    kwargs = {k: v for k, v in bound.arguments.items() if k != "x"}
    with gm.graph.inserting_before(linear.node):
        weight = _operand(gm, linear.weight, linear.node, linear.node)
        if linear.scaling is None:
            fused = gm.graph.call_function(linear_reduce_scatter, (linear.x, weight), kwargs)
        else:
            fused = gm.graph.call_function(fp8_linear_reduce_scatter,
                                           (linear.x, weight, linear.scaling), kwargs)
    info = get_info(linear.node)
    if info is None or get_info(exit_) is None:
        copy_meta(exit_, fused)
    else:
        copy_meta(exit_, fused, kind="linear", flops=info.flops, params=info.params,
                  param_bytes=info.param_bytes)
    exit_.replace_all_uses_with(fused)
    name = linear.node.name
    gm.graph.erase_node(exit_)
    gm.graph.erase_node(linear.node)
    fused.name = name  # stands for the linear and its sum: keep the linear's readable name
    return 1


def _fuse(gm: fx.GraphModule, entry: fx.Node, linears: list[_Linear], fused_ops: dict) -> int:
    """Put the fused op of `entry` where its first linear is; 1 when done, 0 when it cannot be."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    linears = sorted(linears, key=lambda lin: order[lin.node])
    first = linears[0].node
    if not _hoist_operands(linears, first, order):
        log.debug("%s: a weight of its linears is computed after %s, not fused", entry.name,
                  first.name)
        return 0
    weights = tuple(_operand(gm, lin.weight, lin.node, first) for lin in linears)
    biases = tuple(_operand(gm, lin.bias, lin.node, first) for lin in linears)
    bound = inspect.signature(entry.target).bind(*entry.args, **entry.kwargs)
    bound.apply_defaults()
    kwargs = {k: v for k, v in bound.arguments.items() if k != "x"}
    with gm.graph.inserting_before(first):
        if linears[0].scaling is None:
            fused = gm.graph.call_function(fused_ops[entry.target],
                                           (bound.arguments["x"], weights, biases), kwargs)
        else:
            scalings = tuple(lin.scaling for lin in linears)
            fused = gm.graph.call_function(all_gather_fp8_linears,
                                           (bound.arguments["x"], weights, biases, scalings),
                                           kwargs)
    _fused_meta(entry, fused, [lin.node for lin in linears])
    _replace_linears(gm, fused, [lin.node for lin in linears])
    gm.graph.erase_node(entry)
    return 1


def _hoist_operands(linears: list[_Linear], first: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Move weight/bias get_attr nodes made after `first` before it; False if others are."""
    operands = [v for lin in linears for v in (lin.weight, lin.bias, lin.scaling)
                if isinstance(v, fx.Node)]
    late = [v for v in operands if order[v] > order[first]]
    if any(v.op != "get_attr" for v in late):
        return False
    for v in late:
        first.prepend(v)
    return True


def _replace_linears(gm: fx.GraphModule, fused: fx.Node, linears: list[fx.Node]) -> None:
    """Make each linear's users read `fused[i]`, a getitem with the linear's name and meta."""
    anchor = fused
    for index, linear in enumerate(linears):
        with gm.graph.inserting_after(anchor):
            anchor = gm.graph.call_function(operator.getitem, (fused, index))
        copy_meta(linear, anchor)
        linear.replace_all_uses_with(anchor)
        name = linear.name
        gm.graph.erase_node(linear)
        anchor.name = name  # the output stands for the linear: keep its readable name


def _operand(gm: fx.GraphModule, value: fx.Node | str | None, linear: fx.Node,
             before: fx.Node) -> fx.Node | None:
    """The node of a weight or bias: itself, or a new get_attr (before `before`) for a name."""
    if not isinstance(value, str):
        return value
    node = param_node(gm, linear, value)  # the linear's provenance
    before.prepend(node)
    return node


def _fused_meta(entry: fx.Node, fused: fx.Node, linears: list[fx.Node]) -> None:
    """The entry's provenance; the linears' outputs, FLOPs and parameters."""
    infos = [get_info(n) for n in linears]
    if get_info(entry) is None or any(i is None for i in infos):
        copy_meta(entry, fused)
        return
    copy_meta(entry, fused, kind="linear",
              shapes=tuple(s for i in infos for s in i.shapes),
              dtypes=tuple(d for i in infos for d in i.dtypes),
              flops=sum(i.flops for i in infos), params=sum(i.params for i in infos),
              param_bytes=sum(i.param_bytes for i in infos))
