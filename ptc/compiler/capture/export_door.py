"""The export door: capture by `torch.export.export` (non-strict).

Terms: capture opens this door when symbolic tracing fails for a reason
other than a branch on tensor values — Python that needs a concrete value
(`torch.finfo(x.dtype)`, `int(x.size(1))`, ...). Its graph is *aten*-level:
its nodes call aten ops and carry their module in `nn_module_stack`. Its
*output spec* is the pytree spec of forward's outputs, which the graph
itself returns flattened.

Job: export the meta model into an fx graph with a plain calling
convention, quietly: a failure is reported by capture, with the user's line.
"""

from __future__ import annotations

import contextlib
import io
import logging

import torch
from torch import fx, nn

from ptc.compiler.capture.call import FLAG_OVERRIDES, CallRule
from ptc.compiler.capture.evaluate import Evaluator


def export_graph(root: nn.Module, call: CallRule, inputs: dict):
    """(graph, evaluator, module owning the graph's targets, output pytree spec, lifted
    constants) by torch.export.

    The second door: it captures Python that symbolic tracing cannot. Its
    fake values are dropped, since they are in the model's dtype and capture
    recomputes every value on meta tensors. Tensors forward makes from Python
    values are lifted as constants, returned by name (made on the meta device,
    as when they come from indexing a meta tensor, their values are lost).
    """
    kwargs = {k: v for k, v in call.concrete.items() if k in FLAG_OVERRIDES}
    if call.targets:
        kwargs[call.targets] = inputs[call.targets]
    with _quiet(_EXPORT_LOGGERS):  # a failure is reported by capture, with the user's line
        program = torch.export.export(root, (inputs[call.tokens],), kwargs, strict=False)
    unlifted = program.module()
    graph = unlifted.graph
    out_spec = program.call_spec.out_spec
    # Plain calling convention: flat placeholders in, our own output out.
    graph._codegen = fx.graph.CodeGen()
    for node in list(graph.nodes):
        node.meta.pop("val", None)  # fake tensors in the model's dtype; recomputed on meta
    own = {name for name, _ in root.named_buffers()}
    constants = {name: value.detach().clone() for name, value in program.constants.items()
                 if isinstance(value, torch.Tensor) and name not in own}
    return graph, Evaluator(unlifted, inputs), unlifted, out_spec, constants


_EXPORT_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch.export", "torch._export")


@contextlib.contextmanager
def _quiet(names: tuple[str, ...]):
    """Silence these loggers and stderr for the duration.

    A failing torch.export logs warnings and prints its partial graph to
    stderr; capture reports the failure itself, with the user's line.
    """
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
