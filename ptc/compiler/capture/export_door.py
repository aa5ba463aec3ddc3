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
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ptc.compiler.capture.call import FLAG_OVERRIDES, CallRule
from ptc.compiler.capture.evaluate import Evaluator
from ptc.compiler.capture.weights import copy_with_tensors


def export_graph(root: nn.Module, call: CallRule, inputs: dict):
    """(graph, evaluator, module owning the graph's targets, output pytree spec, lifted
    constants) by torch.export.

    The second door: it captures Python that symbolic tracing cannot. Its
    fake values are dropped, since they are in the model's dtype and capture
    recomputes every value on meta tensors. Tensors forward makes from Python
    values (an index list, `x[..., [-2]]`) are lifted as constants, returned by
    name. Made from a meta tensor they are meta, their values lost; those are
    read again from a second export of the model on fake CPU tensors
    (`_constant_values`), where they are real.
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
        if node.target is torch.ops.aten.numpy_T.default and _ndim(node) == 2:
            node.target = torch.ops.aten.t.default  # `w.T` of a matrix: one transpose form
        node.meta.pop("val", None)  # fake tensors in the model's dtype; recomputed on meta
    own = {name for name, _ in root.named_buffers()}
    constants = {name: value.detach().clone() for name, value in program.constants.items()
                 if isinstance(value, torch.Tensor) and name not in own}
    if any(value.is_meta for value in constants.values()):
        constants = _constant_values(root, (inputs[call.tokens],), kwargs, constants)
    return graph, Evaluator(unlifted, inputs), unlifted, out_spec, constants


def _ndim(node: fx.Node) -> int | None:
    """Dimensions of the value export recorded for `node`, if it recorded a tensor."""
    value = node.meta.get("val")
    return value.dim() if isinstance(value, torch.Tensor) else None


def _constant_values(root: nn.Module, args: tuple, kwargs: dict,
                     constants: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`constants` with the meta ones given their values, where a second export finds them.

    The model is exported again with its weights and inputs fake tensors on the
    CPU (nothing is allocated): a tensor forward makes from Python values is then
    a real CPU tensor, lifted with its values. Tracing is deterministic, so the
    constants come under the same names; one that differs in shape or dtype, or
    is still not real, keeps its meta value (capture then refuses the model).
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def on_cpu(x):
        if not isinstance(x, torch.Tensor):
            return x
        with mode:
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")

    try:
        with _quiet(_EXPORT_LOGGERS):
            program = torch.export.export(copy_with_tensors(root, on_cpu), tuple(map(on_cpu, args)),
                                          {k: on_cpu(v) for k, v in kwargs.items()},
                                          strict=False)
    except Exception:  # the first export's result stands; capture names what is lost
        return constants
    found = {}
    for name, value in constants.items():
        real = program.constants.get(name)
        if (value.is_meta and isinstance(real, torch.Tensor) and not real.is_meta
                and not isinstance(real, FakeTensor) and real.shape == value.shape
                and real.dtype == value.dtype):
            value = real.detach().clone()
        found[name] = value
    return found


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
