"""The verifier the runner calls after every pass: a broken graph is blamed on its pass.

Checks, each cheap enough to run between all passes:
- the graph lints (fx's own structural checks);
- every node carries ptc's NodeInfo (a created node got it through `copy_meta`);
- every `get_attr` and `call_module` target exists (no dangling attribute);
- every parameter read by a `get_attr` has the shape its NodeInfo records
  (a pass that resized a weight also updated what later passes read);
- every ptc op that names a mesh axis names one of the plan's mesh axes
  (the runtime binds exactly those to process groups);
- the graph re-run on the meta device gives every node the shapes and
  dtypes its NodeInfo records (what later passes, the memory model and
  `ptc inspect` read). Each mesh axis is bound to a `ShapeGroup` of the
  plan's size, so collectives give the shapes that many ranks would; a
  node that records no shapes (a gather handle) is not compared. Identical
  layers make identical calls, answered once (`ptc.compiler.graph.call_cache`),
  and a node no pass touched since the last check, reading values that
  came out as they did then, is not re-run at all (`Rerun`): after the
  first check a pass costs the meta re-runs of what it changed.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import operator
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

from ptc.compiler.graph.call_cache import (CallCache, Unkeyable, changes_operands, fresh_tree,
                                           signature)
from ptc.compiler.graph.meta import get_info
from ptc.errors import CompileError
from ptc.ops.comm import ShapeGroup, bind_axes
from ptc.plan import Plan

MAX_PROBLEMS = 5
"""Problems listed in one error: the first few say which pass broke what."""


@dataclass(frozen=True, slots=True)
class _Checked:
    """A node as the last meta re-run found it: its call, its record, its value."""

    target: object
    args: tuple
    kwargs: dict
    info: object
    value: object
    signature: tuple


class Rerun:
    """What the meta re-runs of one compile share: call results by key, node values by node.

    fx gives a node new `args`/`kwargs` objects whenever its operands change,
    so a node with the same target and the very same operand objects as at
    the last check, whose input nodes came out with the same metadata, has
    the same value: it is taken from there instead of re-run.
    """

    def __init__(self, root: nn.Module):
        self.calls = CallCache(root)
        """Meta results by call key (identical layers: one evaluation)."""
        self.checked: dict[fx.Node, _Checked] = {}
        """Per node, what its last check found."""


def verify_graph(gm: fx.GraphModule, plan: Plan, *, after: str, shapes: bool = True,
                 rerun: Rerun | None = None) -> None:
    """Check `gm` (see the module docstring); CompileError naming the pass `after` and the node.

    `shapes=False` leaves out the meta re-run (the costly check), for a graph the
    pass did not change; `rerun` shares meta results between the checks of one compile.
    """
    problems: list[str] = []
    try:
        gm.graph.lint()
    except Exception as exc:  # fx raises RuntimeError or AssertionError
        problems.append(f"lint: {exc}")
    for node in gm.graph.nodes:
        problems.extend(_node_problems(gm, node, plan))
        if len(problems) >= MAX_PROBLEMS:
            break
    if not problems and shapes:
        problems = _shape_problems(gm, plan, rerun or Rerun(gm))
    if problems:
        raise CompileError(f"the graph after pass {after} is broken: "
                           + "; ".join(problems[:MAX_PROBLEMS]))


def _node_problems(gm: fx.GraphModule, node: fx.Node, plan: Plan) -> list[str]:
    out = []
    info = get_info(node)
    if info is None and node.op != "output":
        out.append(f"node {node.name} ({node.op} {node.target}) has no ptc metadata")
    if node.op in ("get_attr", "call_module"):
        try:
            value = operator.attrgetter(str(node.target))(gm)
        except AttributeError:
            return [*out, f"node {node.name} reads {node.target}, which the graph module lacks"]
        if (node.op == "get_attr" and isinstance(value, nn.Parameter) and info is not None
                and info.shapes and tuple(info.shapes[0]) != tuple(value.shape)):
            out.append(f"node {node.name} records shape {tuple(info.shapes[0])} for parameter "
                       f"{node.target} of shape {tuple(value.shape)}")
    elif node.op == "call_function":
        axis = _axis(node)
        if axis is not None and axis not in (*plan.parallel.order, "ep", "edp"):
            out.append(f"node {node.name} ({getattr(node.target, '__name__', node.target)}) "
                       f"communicates over axis {axis!r}, which is not a mesh axis of the plan "
                       f"({', '.join(plan.parallel.order)})")
    return out


def _shape_problems(gm: fx.GraphModule, plan: Plan, rerun: Rerun) -> list[str]:
    """Nodes whose meta re-run disagrees with their recorded shapes or dtypes, or fails.

    A placeholder is given its recorded shape; one without (a non-tensor input)
    leaves every node that reads it unchecked. Weights are read as meta
    tensors even where a graph holds real ones.
    """
    groups = {axis: ShapeGroup(plan.parallel.degree(axis)) for axis in plan.parallel.order}
    groups["dp"] = ShapeGroup(plan.grad_ranks)  # what the runtime binds "dp" to: dp·cp ranks
    groups["ep"] = ShapeGroup(plan.parallel.ep)
    groups["edp"] = ShapeGroup(plan.expert_grad_ranks)
    cache = rerun.calls.for_root(gm)
    interp = _MetaInterpreter(gm, cache)
    unknown, same, problems = set(), set(), []
    with bind_axes(groups), torch.no_grad():
        for node in gm.graph.nodes:
            info = get_info(node)
            if node.op == "output" or any(a in unknown for a in node.all_input_nodes):
                unknown.add(node)
                continue
            last = rerun.checked.get(node)
            if _unchanged(node, last, same):
                interp.env[node] = last.value  # shared: no call writes into it (run_node)
                same.add(node)
                if info is last.info:  # checked against this very record last time
                    continue
                value = interp.env[node]
            elif node.op == "placeholder":
                if info is None or len(info.shapes) != 1:
                    unknown.add(node)
                    continue
                value = torch.empty(info.shapes[0], dtype=info.dtypes[0], device="meta")
            else:
                try:
                    value = interp.run_node(node)
                except Exception as exc:  # any op's own error: the node is what is named
                    first = str(exc).splitlines()[0] if str(exc) else ""
                    problems.append(f"node {node.name} ({node.op} {_name(node)}) fails when "
                                    f"re-run: {type(exc).__name__}: {first}")
                    break
                if changes_operands(node):  # what reads its operands from here on reads
                    same.difference_update(node.all_input_nodes)  # them changed
            interp.env[node] = value
            problem = _disagreement(node, info, value)
            if problem:
                problems.append(problem)
                if len(problems) >= MAX_PROBLEMS:
                    break
            elif node not in same:
                _remember(rerun, node, info, value, last, same)
    return problems


def _unchanged(node: fx.Node, last: _Checked | None, same: set[fx.Node]) -> bool:
    """Whether `node` makes the call it made at its last check, on values that came out alike."""
    return (last is not None and node.op in ("call_function", "call_method")
            and node.target is last.target and node.args is last.args
            and node.kwargs is last.kwargs and all(a in same for a in node.all_input_nodes))


def _remember(rerun: Rerun, node: fx.Node, info, value, last: _Checked | None,
              same: set[fx.Node]) -> None:
    """Keep what the check of `node` found; mark it `same` when its value came out as last time."""
    try:
        sig = signature(value)
    except Unkeyable:  # a handle: nothing to hand out again
        rerun.checked.pop(node, None)
        return
    if last is not None and last.signature == sig:
        same.add(node)
    rerun.checked[node] = _Checked(node.target, node.args, node.kwargs, info, value, sig)


class _MetaInterpreter(fx.Interpreter):
    """fx's Interpreter with every weight it reads (attribute or module state) on meta.

    A GraphModule it calls (a pipeline stage, a checkpoint region) is run node
    by node through `cache` too, so the layers inside it cost one evaluation
    of each distinct call.
    """

    def __init__(self, gm: fx.GraphModule, cache: CallCache):
        super().__init__(gm, garbage_collect_values=False)
        self.cache = cache

    def run_node(self, node: fx.Node):  # noqa: D102 - fx.Interpreter's
        if node.op not in ("call_function", "call_method", "call_module"):
            return super().run_node(node)
        if changes_operands(node):  # it writes into its operands: into copies of their own,
            for arg in node.all_input_nodes:  # never into values other checks share
                self.env[arg] = fresh_tree(self.env[arg])
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        return self.cache.call(node, args, kwargs, lambda: getattr(self, node.op)(
            node.target, args, kwargs))

    def get_attr(self, target, args, kwargs):  # noqa: D102 - fx.Interpreter's
        return _on_meta(super().get_attr(target, args, kwargs))

    def call_module(self, target, args, kwargs):  # noqa: D102 - fx.Interpreter's
        module = self.fetch_attr(target)
        if isinstance(module, fx.GraphModule) and not kwargs:
            return _MetaInterpreter(module, self.cache.for_root(module)).run(*args)
        state = {name: _on_meta(t) for name, t in itertools.chain(
            module.named_parameters(remove_duplicate=False),
            module.named_buffers(remove_duplicate=False))}
        return torch.func.functional_call(module, state, args, kwargs)


def _on_meta(value):
    if isinstance(value, torch.Tensor) and value.device.type != "meta":
        return torch.empty_like(value, device="meta").requires_grad_(value.requires_grad)
    return value


def _disagreement(node: fx.Node, info, value) -> str | None:
    """What the node's recorded shapes/dtypes get wrong about `value`, or None."""
    if info is None or not info.shapes:
        return None
    tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    shapes = tuple(tuple(t.shape) for t in tensors)
    dtypes = tuple(t.dtype for t in tensors)
    recorded = tuple(tuple(s) for s in info.shapes)
    if recorded == shapes and tuple(info.dtypes) == dtypes:
        return None
    return (f"node {node.name} ({node.op} {_name(node)}) records shapes {recorded} dtypes "
            f"{_dtypes(info.dtypes)}, a meta re-run gives {shapes} {_dtypes(dtypes)}")


def _name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def _dtypes(dtypes) -> str:
    return "(" + ", ".join(str(d).removeprefix("torch.") for d in dtypes) + ")"


def _axis(node: fx.Node) -> str | None:
    """The mesh axis a ptc op names (its `axis` argument, or that argument's default)."""
    target = node.target
    if not getattr(target, "__module__", "").startswith("ptc.ops."):
        return None
    params = _axis_signature(target)
    if params is None:
        return None
    try:
        bound = params.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    axis = bound.arguments["axis"]
    return axis if isinstance(axis, str) else None


@functools.cache
def _axis_signature(target) -> inspect.Signature | None:
    """The signature of a ptc op that takes an `axis`, or None (read once per op)."""
    try:
        params = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    return params if "axis" in params.parameters else None
