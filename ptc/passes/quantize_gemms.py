"""The quantize_gemms pass: run the layers' GEMMs through float8 (`train.dtype = fp8`).

Each linear `nodes.is_fp8_linear` picks (those of the transformer layers;
not the embedding or the LM head, which Transformer Engine also keeps in
bf16, nor a mixture of experts' router, which Megatron-Core keeps in high
precision) becomes

    fp8_linear(x, weight, bias, scaling)

where `scaling` is a get_attr node of the linear's own `Fp8Scaling` module
(`fp8.<linear path with _>`), the state of its scales and amax history
(`ptc.ops.fp8_linear`). Each grouped product of a layer's routed experts
`nodes.is_fp8_grouped` picks (`grouped_mm(x, W, offs)`: Megatron-Core with
Transformer Engine runs these in float8 too, as TEGroupedLinear) becomes

    fp8_grouped_mm(x, W, offs, scaling)

with an `Fp8Scaling` of its own (`fp8.<stack name with _>`) that scales each
expert's weight apart (`ptc.ops.fp8_grouped`). The pass runs after
tensor_parallel, sequence_parallel and expert_parallel, so the ops multiply
the rank's shard of each weight, a grouped product the rows an ep rank
received by its local experts with their local offsets, and reduce their
amaxes over tp; and before the pipeline split and the per-stage passes, so
ZeRO-3 rewrites the weights they read as it does a linear's, and a
checkpointed region is handed the scaling modules as inputs. The tp
comm_overlap fusion, which fuses bf16 linears with their entry collective,
leaves these alone.

Each `Fp8Scaling` carries `train.fp8_recipe` and the GEMM's tp role, read
from the tp pass's record of its weight (`TensorParallelLayout`): column- or
row-parallel, which says the scale vectors a rowwise GEMM reduces over tp.
mxfp8 needs whole 32-element blocks along every contraction dimension on each
rank; a linear, a grouped product or a sequence length that has none is
refused here, in one line naming it (no padding; a grouped product's
weight gradient contracts each expert's rows, whose last block holds what
is left, `ptc.ops.fp8_grouped`).
"""

from __future__ import annotations

import logging

from torch import fx

from ptc.compiler.records.decisions import Decisions
from ptc.compiler.graph.meta import copy_meta
from ptc.compiler.graph.meta import graph_record
from ptc.compiler.graph.nodes import (_arg, is_fp8_grouped, is_fp8_linear, linear_weight,
                                      op_name, where)
from ptc.compiler.graph.tp_structure import COLWISE, ROWWISE
from ptc.errors import CompileError
from ptc.passes.functional import functionalize
from ptc.passes.linear_form import to_linear_form
from ptc.ops.expert_parallel import EP
from ptc.ops.fp8_grouped import fp8_grouped_mm
from ptc.ops.fp8_linear import COLUMN, MX_BLOCK, ROW, Fp8Scaling, fp8_linear
from ptc.ops.tp_ops import TP

log = logging.getLogger("ptc.passes.quantize_gemms")

STATE_PREFIX = "fp8"
"""Submodule of the graph that holds the GEMMs' `Fp8Scaling` modules."""


def quantize_gemms_pass(gm: fx.GraphModule, decisions: Decisions) -> fx.GraphModule:
    """Replace the layers' linears and experts' grouped products by float8 ones, each with
    its Fp8Scaling state.

    Float8 operands double the GEMMs' peak rate on GPUs that have them and
    halve the bytes their saved inputs take, at 3 (e4m3) or 2 (e5m2)
    mantissa bits. Runs when `train.dtype` is "fp8".
    """
    train = decisions.plan.train
    if train.dtype != "fp8":
        return gm
    to_linear_form(gm)  # Conv1D's addmm, x @ W: F.linear like the rest
    if train.fp8_recipe == "mxfp8":
        _check_mx_tokens(decisions)
    linears = grouped = 0
    for node in list(gm.graph.nodes):
        if (path := is_fp8_linear(node)) is not None:
            node = functionalize(gm, node)
            if op_name(node) != "linear":
                continue  # a product of a reshaped weight, not one matrix: left in bf16
            x, weight, bias = _operands(node)
            param = linear_weight(node)
            if train.fp8_recipe == "mxfp8":
                _check_mx_features(gm, f"linear {path}", param)
            _replace(gm, node, path, fp8_linear, (x, weight, bias),
                     _scaling(gm, param, train))
            linears += 1
        elif (path := is_fp8_grouped(node)) is not None:
            param = linear_weight(node)
            if train.fp8_recipe == "mxfp8":
                _check_mx_features(gm, f"grouped product {where(node)} of expert stack {path}",
                                   param)
            operands = (*node.args[:2], _arg(node, 2, "offs"))
            _replace(gm, node, path, fp8_grouped_mm, operands,
                     _scaling(gm, param, train, experts=_experts(gm, param), expert_axis=EP))
            grouped += 1
    if linears or grouped:
        gm.graph.lint()
        gm.recompile()
    log.info("inserted %d fp8_linear (%s, %s scaling%s)%s", linears, train.fp8_recipe,
             train.fp8_scaling, ", emulated" if train.fp8_emulate else "",
             f" and {grouped} fp8_grouped_mm" if grouped else "")
    return gm


def _scaling(gm: fx.GraphModule, param: str | None, train, **experts) -> Fp8Scaling:
    """The scaling state, as `train` says, of a GEMM by the weight `param`; `experts`: a
    grouped product's (`Fp8Scaling`'s experts and expert_axis)."""
    return Fp8Scaling(delayed=train.fp8_scaling == "delayed", window=train.fp8_amax_history,
                      emulate=train.fp8_emulate, axis=TP, recipe=train.fp8_recipe,
                      role=_role(gm, param), **experts)


def _replace(gm: fx.GraphModule, node: fx.Node, path: str, op, operands: tuple,
             scaling: Fp8Scaling) -> None:
    """Put `op(*operands, state)` in the place of `node`, `state` reading `scaling` as
    `fp8.<path with _>`, the new node under the old one's name and metadata."""
    name = f"{STATE_PREFIX}.{path.replace('.', '_')}"
    gm.add_submodule(name, scaling)
    with gm.graph.inserting_before(node):
        state = gm.graph.get_attr(name)
        new = gm.graph.call_function(op, (*operands, state))
    copy_meta(node, state, kind="other", shapes=(), dtypes=(), flops=0, params=0,
              param_bytes=0)
    copy_meta(node, new)
    node.replace_all_uses_with(new)
    new_name = node.name
    gm.graph.erase_node(node)
    new.name = new_name  # stands for the GEMM: keep its readable name


def _experts(gm: fx.GraphModule, param: str) -> int:
    """The routed experts of stack `param`, all of them (expert parallelism keeps 1/ep)."""
    layout = graph_record(gm).expert_parallel
    if layout is not None and layout.is_expert(param):
        return layout.params[param].full_shape[0]
    return gm.get_parameter(param).shape[0]


def _operands(node: fx.Node) -> tuple:
    """(input, weight, bias) of an F.linear / aten.linear node."""
    names = ("input", "weight", "bias")
    values = [node.args[i] if len(node.args) > i else node.kwargs.get(name)
              for i, name in enumerate(names)]
    return tuple(values)


def _role(gm: fx.GraphModule, param: str | None) -> str | None:
    """COLUMN or ROW: how the tp pass split the linear's weight `param`; None if it did not."""
    layout = graph_record(gm).tensor_parallel
    shard = layout.params.get(param) if layout is not None and param else None
    return {COLWISE: COLUMN, ROWWISE: ROW}.get(shard.style) if shard is not None else None


def _check_mx_features(gm: fx.GraphModule, what: str, param: str | None) -> None:
    """Refuse an mxfp8 GEMM (`what`, named) whose rank's input or output features (forward's
    and dgrad's contraction dimensions) are no whole number of 32-element blocks."""
    out_features, in_features = gm.get_parameter(param).shape[-2:]
    if in_features % MX_BLOCK or out_features % MX_BLOCK:
        raise CompileError(f"train.fp8_recipe = mxfp8: {what} has {in_features} input "
                           f"and {out_features} output features on each rank, not multiples of "
                           f"{MX_BLOCK} (its GEMMs contract both in blocks of {MX_BLOCK}); use "
                           "fp8_recipe = rowwise or tensorwise")


def _check_mx_tokens(decisions: Decisions) -> None:
    """Refuse mxfp8 where the tokens a rank's weight-gradient GEMM contracts (a micro-batch,
    and under sequence parallelism each rank's sequence chunk) hold no whole 32-blocks."""
    plan = decisions.plan
    par, train = plan.parallel, plan.train
    chunk = train.seq_len // par.cp
    what = f"micro_batch · seq_len / cp = {train.micro_batch * chunk}"
    tokens = train.micro_batch * chunk
    if par.sequence_parallel and par.tp > 1:
        tokens, what = chunk // par.tp, f"seq_len / (cp · tp) = {chunk // par.tp} per rank"
    if tokens % MX_BLOCK:
        raise CompileError(f"train.fp8_recipe = mxfp8: train.seq_len: {what} tokens, not a "
                           f"multiple of {MX_BLOCK} (the weight gradients contract tokens in "
                           f"blocks of {MX_BLOCK})")
