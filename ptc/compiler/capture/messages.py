"""Messages: the CaptureError texts, each naming the module and user line at fault.

Terms: a failure's *site* is the module (path, class) and the user frame
(file, line, text) where it happened; `_where` writes it as "in module 'p'
(Cls) at file:line" followed by the line itself. Every message says what
failed, where, and how to make the model capturable.

Job: turn a failure of a door, of meta evaluation or of the output rule
into the text of the CaptureError that capture raises; nothing here raises.
(The call rule's two refusals need no site and stay with the rule.)
"""

from __future__ import annotations

import torch
from torch import nn

from ptc.compiler.graph import nodes
from ptc.compiler.capture.annotate import is_library, line_text, short_path, source_line
from ptc.compiler.capture.evaluate import DataDependent, Evaluator, NodeFailed


def _failure_site(exc: BaseException, root: nn.Module | None,
                  module=None) -> tuple[tuple | None, tuple | None]:
    """(module (path, class), user frame) where a tracing exception was raised.

    The frame is the innermost one in user code; the module is the one the
    fx tracer recorded, else the `self` of the innermost user frame that is
    a module of `root`.
    """
    frame, owner = None, None
    names = {id(m): n for n, m in root.named_modules()} if root is not None else {}
    tb = exc.__traceback__
    while tb is not None:  # the innermost user frame wins
        code = tb.tb_frame.f_code
        if not is_library(code.co_filename):
            frame = (code.co_filename, tb.tb_lineno, line_text(code.co_filename, tb.tb_lineno))
            this = tb.tb_frame.f_locals.get("self")
            if isinstance(this, nn.Module) and id(this) in names:
                owner = (names[id(this)], type(this).__name__)
        tb = tb.tb_next
    return module or owner, frame


def _where(module, frame) -> str:
    """"in module 'p' (Cls) at file:line" plus the line's text, or what is known of it."""
    parts = []
    if module:
        path, cls = module
        parts.append(f"in module {path or '<root>'!r} ({cls})")
    if frame:
        filename, lineno, _ = frame
        parts.append(f"at {short_path(filename)}:{lineno}")
    text = " ".join(parts) or "at an unknown place"
    if frame and frame[2]:
        text += f"\n    {frame[2]}"
    return text


def data_dependent_message(model: nn.Module, dd: DataDependent) -> str:
    """A branch on tensor values, where it is, and how to rewrite it.

    Said at once, without trying the export door, since no door can capture it.
    """
    return (
        f"cannot capture {type(model).__name__}: Python control flow depends on tensor values "
        f"{_where(dd.module, dd.frame)}\n"
        "The graph would differ from batch to batch, so neither torch.fx nor torch.export "
        "can capture it. To make it capturable:\n"
        "  - remove the data-dependent branch: compute both sides and select with "
        "torch.where(cond, a, b), or use a mask;\n"
        "  - or express it with torch.cond (torch.export-friendly control flow).\n"
        "Branches on shapes and config flags (if x.size(1) > 1, if mask is not None) are fine.")


def untraceable_message(model: nn.Module, root: nn.Module, fx_exc: BaseException | None,
                        ex_exc: BaseException | None) -> str:
    """Why neither door worked, where (fx's failure site, else export's), and the fixes."""
    module, frame = None, None
    for exc in (fx_exc, ex_exc):
        if exc is not None and frame is None:
            module, frame = _failure_site(exc, root, getattr(exc, "_ptc_module", None))

    def line(exc):
        return "not tried" if exc is None else f"{type(exc).__name__}: {_one_line(exc)}"

    return (
        f"cannot capture {type(model).__name__}: tracing failed {_where(module, frame)}\n"
        f"  torch.fx: {line(fx_exc)}\n"
        f"  torch.export: {line(ex_exc)}\n"
        "To make it capturable, one of:\n"
        "  - mark the module a leaf: capture(..., leaf_modules=(ThatModule,)) — it stays one "
        "call_module node, run as is on meta tensors;\n"
        "  - remove data-dependent control flow and Python that needs concrete tensor values "
        "(int(t), t.item(), len(t), torch.finfo(t.dtype) on traced values);\n"
        "  - write it torch.export-friendly (torch.cond for branches, no .item()).")


def meta_failure_message(model: nn.Module, failed: NodeFailed) -> str:
    """A node that failed on meta tensors, its module and line, and the fixes.

    Such an op most often lacks a meta kernel; the message says so.
    """
    src = source_line(failed.node)
    path, cls = nodes.stack_entry(failed.node)
    where = f"module {path!r} ({nodes.class_name(cls)})" if path else "the model's forward"
    return (f"cannot capture {type(model).__name__}: computing shapes on the meta device failed "
            f"at node {failed.node.name} in {where}{' at ' + src if src else ''}: "
            f"{type(failed.exc).__name__}: {_one_line(failed.exc)}\n"
            "The op may lack a meta kernel; mark its module a leaf "
            "(capture(..., leaf_modules=(ThatModule,))) or use a standard torch op.")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else ""


def no_logits_message(model_name: str, leaves, evaluator: Evaluator, b: int,
                      s: int) -> str:
    """No output passes for the logits: what capture looks for and what it found.

    `leaves` are the model's outputs as (name, node) pairs ("" when unnamed),
    listed with their shapes so the user sees which output to rename.
    """
    found = []
    for name, node in leaves:
        value = evaluator.value(node)
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        found.append(f"{name or node.name}: {shape}")
    return (f"cannot find the logits among {model_name}'s outputs: capture needs a "
            f"floating tensor of shape [{b}, {s}, vocab] (or an output named 'logits'); "
            f"found {', '.join(found) or 'nothing'}")



def lost_constant_message(model: nn.Module, graph: torch.fx.Graph, names: list[str]) -> str:
    """Why a tensor constant that forward builds on the fly cannot be captured, and the fix."""
    node = next(n for n in graph.nodes if n.op == "get_attr" and str(n.target) == names[0])
    user = next(iter(node.users), node)
    where = source_line(user) or "its forward"
    module = str(node.target).rpartition(".")[0] or type(model).__name__
    return (f"{type(model).__name__}: module {module!r} builds a tensor from Python values "
            f"at {where} (such as an index list, x[..., [-2]]; {len(names)} in all); capture "
            "runs on the meta device, where its values are lost; write it as a slice "
            "(x[..., -2:-1]) or a registered buffer")


def not_causal_message(model_name: str, node: torch.fx.Node, why: str) -> str:
    """An attention that lets a position see later tokens: where, why, and what would train."""
    return (f"{model_name} is not a causal language model: the attention at {nodes.where(node)} "
            f"lets a position see later tokens ({why}); ptc trains next-token prediction, "
            "where position t may see tokens 0..t only. Give it a decoder (a ...ForCausalLM) "
            "or mask the attention causally (is_causal=True, or a mask that hides later keys)")
