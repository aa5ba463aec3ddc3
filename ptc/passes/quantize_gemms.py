"""The quantize_gemms pass: run the layers' linears through float8 GEMMs (`train.dtype = fp8`).

Each linear `nodes.is_fp8_linear` picks (those of the transformer layers;
not the embedding, the LM head or expert stacks, which Transformer Engine
also keeps in bf16) becomes

    fp8_linear(x, weight, bias, scaling)

where `scaling` is a get_attr node of the linear's own `Fp8Scaling` module
(`fp8.<linear path with _>`), the state of its scales and amax history
(`ptc.ops.fp8_linear`). The pass runs after tensor_parallel and
sequence_parallel, so the op multiplies the rank's shard of the weight and
reduces its amaxes over tp; and before the pipeline split and the per-stage
passes, so ZeRO-3 rewrites the weight it reads as it does a linear's, and a
checkpointed region is handed the scaling module as an input. The tp
comm_overlap fusion, which fuses bf16 linears with their entry collective,
leaves these alone.

Each `Fp8Scaling` carries `train.fp8_recipe` and the linear's tp role, read
from the tp pass's record of its weight (`TensorParallelLayout`): column- or
row-parallel, which says the scale vectors a rowwise linear reduces over tp.
mxfp8 needs whole 32-element blocks along every contraction dimension on each
rank; a linear or a sequence length that has none is refused here, in one
line naming it (no padding).
"""

from __future__ import annotations

import logging

from torch import fx

from ptc.compiler.records.decisions import Decisions
from ptc.compiler.graph.meta import copy_meta
from ptc.compiler.graph.meta import graph_record
from ptc.compiler.graph.nodes import is_fp8_linear, linear_weight, op_name
from ptc.compiler.graph.tp_structure import COLWISE, ROWWISE
from ptc.errors import CompileError
from ptc.passes.functional import functionalize
from ptc.passes.linear_form import to_linear_form
from ptc.ops.fp8_linear import COLUMN, MX_BLOCK, ROW, Fp8Scaling, fp8_linear
from ptc.ops.tp_ops import TP

log = logging.getLogger("ptc.passes.quantize_gemms")

STATE_PREFIX = "fp8"
"""Submodule of the graph that holds the linears' `Fp8Scaling` modules."""


def quantize_gemms_pass(gm: fx.GraphModule, decisions: Decisions) -> fx.GraphModule:
    """Replace the layers' linears by fp8_linear calls, each with its Fp8Scaling state.

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
    done = 0
    for node in list(gm.graph.nodes):
        path = is_fp8_linear(node)
        if path is None:
            continue
        node = functionalize(gm, node)
        if op_name(node) != "linear":
            continue  # a product of a reshaped weight, not one matrix: left in bf16
        x, weight, bias = _operands(node)
        param = linear_weight(node)
        if train.fp8_recipe == "mxfp8":
            _check_mx_features(gm, path, param)
        name = f"{STATE_PREFIX}.{path.replace('.', '_')}"
        gm.add_submodule(name, Fp8Scaling(delayed=train.fp8_scaling == "delayed",
                                          window=train.fp8_amax_history,
                                          emulate=train.fp8_emulate, axis=TP,
                                          recipe=train.fp8_recipe, role=_role(gm, param)))
        with gm.graph.inserting_before(node):
            state = gm.graph.get_attr(name)
            new = gm.graph.call_function(fp8_linear, (x, weight, bias, state))
        copy_meta(node, state, kind="other", shapes=(), dtypes=(), flops=0, params=0,
                  param_bytes=0)
        copy_meta(node, new)
        node.replace_all_uses_with(new)
        new_name = node.name
        gm.graph.erase_node(node)
        new.name = new_name  # stands for the linear: keep its readable name
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    log.info("inserted %d fp8_linear (%s, %s scaling%s)", done, train.fp8_recipe,
             train.fp8_scaling, ", emulated" if train.fp8_emulate else "")
    return gm


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


def _check_mx_features(gm: fx.GraphModule, path: str, param: str | None) -> None:
    """Refuse an mxfp8 linear whose rank's input or output features (forward's and dgrad's
    contraction dimensions) are no whole number of 32-element blocks."""
    out_features, in_features = gm.get_parameter(param).shape
    if in_features % MX_BLOCK or out_features % MX_BLOCK:
        raise CompileError(f"train.fp8_recipe = mxfp8: linear {path} has {in_features} input "
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
