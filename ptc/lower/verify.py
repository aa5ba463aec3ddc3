"""The verifier the runner calls after every pass: a broken graph is blamed on its pass.

Checks, each cheap enough to run between all passes:
- the graph lints (fx's own structural checks);
- every node carries ptc's NodeInfo (a created node got it through `copy_meta`);
- every `get_attr` and `call_module` target exists (no dangling attribute);
- every parameter read by a `get_attr` has the shape its NodeInfo records
  (a pass that resized a weight also updated what later passes read);
- every ptc op that names a mesh axis names one of the plan's mesh axes
  (the runtime binds exactly those to process groups).
"""

from __future__ import annotations

import inspect

from torch import fx, nn

from ptc.compiler.meta import get_info
from ptc.errors import CompileError
from ptc.plan import Plan

def verify_graph(gm: fx.GraphModule, plan: Plan, *, after: str) -> None:
    """Check `gm` (see the module docstring); CompileError naming the pass `after` and the node."""
    problems: list[str] = []
    try:
        gm.graph.lint()
    except Exception as exc:  # fx raises RuntimeError or AssertionError
        problems.append(f"lint: {exc}")
    for node in gm.graph.nodes:
        problems.extend(_node_problems(gm, node, plan))
        if len(problems) >= 5:
            break
    if problems:
        raise CompileError(f"the graph after pass {after} is broken: " + "; ".join(problems[:5]))


def _node_problems(gm: fx.GraphModule, node: fx.Node, plan: Plan) -> list[str]:
    out = []
    info = get_info(node)
    if info is None and node.op != "output":
        out.append(f"node {node.name} ({node.op} {node.target}) has no ptc metadata")
    if node.op in ("get_attr", "call_module"):
        try:
            value = _attr(gm, str(node.target))
        except AttributeError:
            return [*out, f"node {node.name} reads {node.target}, which the graph module lacks"]
        if (node.op == "get_attr" and isinstance(value, nn.Parameter) and info is not None
                and info.shapes and tuple(info.shapes[0]) != tuple(value.shape)):
            out.append(f"node {node.name} records shape {tuple(info.shapes[0])} for parameter "
                       f"{node.target} of shape {tuple(value.shape)}")
    elif node.op == "call_function":
        axis = _axis(node)
        if axis is not None and axis not in plan.parallel.order:
            out.append(f"node {node.name} ({getattr(node.target, '__name__', node.target)}) "
                       f"communicates over axis {axis!r}, which is not a mesh axis of the plan "
                       f"({', '.join(plan.parallel.order)})")
    return out


def _attr(gm: fx.GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _axis(node: fx.Node) -> str | None:
    """The mesh axis a ptc op names (its `axis` argument, or that argument's default)."""
    target = node.target
    if not getattr(target, "__module__", "").startswith("ptc.ops."):
        return None
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    if "axis" not in signature.parameters:
        return None
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    axis = bound.arguments["axis"]
    return axis if isinstance(axis, str) else None
