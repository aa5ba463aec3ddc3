"""Capture a model as one annotated fx graph on the meta device.

Two front doors, one IR (see DESIGN.md):

1. **fx** (`fx_door`) — `torch.fx.symbolic_trace` with a tracer that keeps
   torch.nn modules as leaves and follows shape-dependent branches taken at
   the captured (micro_batch, seq_len), just as torch.export specialises. A
   branch on tensor *values* cannot be captured; that is reported at once
   with the module and line.
2. **export** (`export_door`) — when symbolic tracing fails for another
   reason (Python that needs a concrete value: `torch.finfo(x.dtype)`,
   `int(x.size(1))`, ...), `torch.export.export` (non-strict) gives an aten
   graph whose nodes carry their module in `nn_module_stack`.

Both run on a meta copy of the model in the compute dtype (`weights`), so no
weight is ever allocated, and call forward by one rule (`call`). The graph is
then normalised (`normalise`: placeholders `tokens` and, with a loss,
`targets`; one output), shape-propagated on meta tensors (`evaluate`), and
every node annotated once with a `NodeInfo` (`annotate`, ptc.compiler.graph.meta).
A fused attention handed exactly the causal mask asks for the causal kernel
instead (`causal_kernel`), and each dropout becomes a numbered site
(`dropout_sites`).
What cannot be captured is said by `messages`, with the user's module and line.

Public API: `capture(model, ...)` and `with_weights(gm, model)`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx, nn

from ptc.compiler.capture.annotate import annotate_graph, find_blocks
from ptc.compiler.capture.call import call_rule
from ptc.compiler.capture.causal_kernel import ask_for_the_causal_kernel
from ptc.compiler.capture.evaluate import DataDependent, NodeFailed
from ptc.compiler.capture.dropout_sites import number_dropout_sites
from ptc.compiler.capture.export_door import export_graph
from ptc.compiler.capture.fx_door import fx_graph
from ptc.compiler.capture.messages import (data_dependent_message, lost_constant_message,
                                           meta_failure_message, not_causal_message,
                                           untraceable_message)
from ptc.compiler.capture.normalise import normalise_io
from ptc.compiler.capture.weights import keep_tied_names, meta_model, with_weights
from ptc.compiler.graph.lazy_code import graph_module
from ptc.compiler.graph.masks import MaskReader
from ptc.compiler.records.graph_meta import CaptureInfo, GraphRecord
from ptc.compiler.graph.meta import graph_info, set_graph_record, update_graph_record
from ptc.errors import CaptureError

__all__ = ["capture", "with_weights"]

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def capture(model: nn.Module, *, micro_batch: int, seq_len: int,
            dtype: torch.dtype | str = torch.float32, with_loss: bool = True,
            leaf_modules: tuple = (), front_door: str = "auto",
            buffers_as_built: bool = False) -> fx.GraphModule:
    """Capture `model` at batch (micro_batch, seq_len) as an annotated GraphModule.

    The graph takes `tokens` (and `targets` when `with_loss`) and returns the
    logits[b, s, V], or the mean cross-entropy loss when `with_loss`. Its
    parameters are meta tensors in `dtype` with the model's own names (bind
    it to real weights with `with_weights` to run it). Every node has a
    NodeInfo under node.meta["ptc"]; the graph a GraphRecord holding its
    CaptureInfo under gm.meta["ptc"]. `dtype` is a torch dtype or "fp32" / "bf16" / "fp16".

    `leaf_modules`: module classes, or fnmatch globs of module paths, that
    the fx door keeps as single call_module nodes (for modules whose Python
    cannot be traced but runs fine on meta tensors).
    `front_door`: "auto" (fx, then export), or "fx" / "export" to force one
    (tests use it to check that both graphs answer the same).
    `buffers_as_built`: floating buffers keep the dtype the model made them in, as the
    runtime binds them (a RoPE table cast to the compute dtype where it is used is then a
    copy autograd may save: what the memory profile must see).
    Raises CaptureError, naming the module and source line, when neither
    front door can capture the model, or (with a loss: ptc trains next-token
    prediction) when an attention lets a position see later tokens.
    """
    if front_door not in ("auto", "fx", "export"):
        raise ValueError(f"front_door must be 'auto', 'fx' or 'export', got {front_door!r}")
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    call = call_rule(model)
    root = meta_model(model, dtype, buffers_as_built=buffers_as_built)
    inputs = {call.tokens: torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")}
    if call.targets:
        inputs[call.targets] = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")
    door, graph, evaluator, owner, out_spec, constants = _open_a_door(
        model, root, call, inputs, leaf_modules, front_door)
    graph.owning_module = owner  # DCE's purity check looks modules up (GraphModule resets it)
    try:
        vocab, model_loss = normalise_io(graph, call, evaluator, out_spec, micro_batch,
                                         seq_len, with_loss, aten=door == "export",
                                         model_name=type(model).__name__)
    except NodeFailed as failed:
        raise CaptureError(meta_failure_message(model, failed)) from failed.exc
    lost = [name for name, value in constants.items() if value.is_meta]
    if lost:
        raise CaptureError(lost_constant_message(model, graph, lost))
    gm = graph_module(owner, graph, type(model).__name__)
    keep_tied_names(gm, root)
    blocks, num_layers = find_blocks(root)
    set_graph_record(gm, GraphRecord(capture=CaptureInfo(
        front_door=door, model_class=type(model).__name__, micro_batch=micro_batch,
        seq_len=seq_len, dtype=dtype, with_loss=with_loss, model_loss=model_loss,
        blocks_path=blocks, num_layers=num_layers, vocab=vocab, constants=constants,
        frozen=tuple(name for name, p in model.named_parameters(remove_duplicate=False)
                     if not p.requires_grad))))
    annotate_graph(gm, root, evaluator, blocks, dtype)
    reader = MaskReader({name: value for name, value in model.named_buffers()
                         if not value.is_meta})
    if with_loss:
        _refuse_a_model_that_sees_later_tokens(gm, model, reader)
    causal_masks = ask_for_the_causal_kernel(gm, reader)
    if causal_masks:
        update_graph_record(gm, capture=dataclasses.replace(graph_info(gm),
                                                            causal_masks=causal_masks))
    number_dropout_sites(gm, micro_batch, seq_len)
    return gm


def _refuse_a_model_that_sees_later_tokens(gm: fx.GraphModule, model: nn.Module,
                                           reader: MaskReader) -> None:
    """CaptureError at the first attention whose mask lets a query see a later key: trained
    on next tokens, such a model would learn to copy its input (ptc.compiler.graph.masks). Masks
    kept as buffers are read from `model` where it holds them off the meta device (`reader`)."""
    for node in gm.graph.nodes:
        why = reader.later_keys_seen(node)
        if why is not None:
            raise CaptureError(not_causal_message(type(model).__name__, node, why))


def _open_a_door(model, root, call, inputs, leaf_modules, front_door):
    """(door, graph, evaluator, owner, out_spec, lifted constants) from fx, else export;
    CaptureError if neither."""
    fx_exc = None
    if front_door != "export":
        try:
            return ("fx", *fx_graph(root, call, inputs, leaf_modules), {})
        except DataDependent as dd:  # no door can capture this: say so at once
            raise CaptureError(data_dependent_message(model, dd)) from None
        except Exception as exc:  # anything symbolic tracing cannot do: try the other door
            if front_door == "fx":
                raise CaptureError(untraceable_message(model, root, exc, None)) from exc
            fx_exc = exc
    try:
        return ("export", *export_graph(root, call, inputs))
    except Exception as ex_exc:
        raise CaptureError(untraceable_message(model, root, fx_exc, ex_exc)) from ex_exc
