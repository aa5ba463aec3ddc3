"""Meta evaluation: the value of every node, computed on meta tensors.

Terms: a node's *value* is what running it on meta tensors returns (meta
tensors carry shape, dtype and strides, never data); it is memoised per
node and also stored as torch's node.meta["val"]. A node's FLOPs are
*counted* here when they can only be known by running it
(flops.needs_running). The two failures met on the way are `NodeFailed`
(an op raised on meta tensors) and `DataDependent` (the fx door met a
branch on tensor values; evaluation lets it through untouched).

Job: the `Evaluator`, shared by the fx door (to decide shape-dependent
branches), the normalisation (shape propagation of the whole graph) and
the annotation (FLOPs and shapes of every node).
"""

from __future__ import annotations

import operator

import torch
from torch import fx, nn

from ptc.compiler.graph import flops as flops_mod
from ptc.compiler.graph import nodes
from ptc.compiler.graph.call_cache import CallCache, changes_operands


class Evaluator:
    """Computes node values on meta tensors, each node once, in any order.

    Used while tracing (to decide shape-dependent branches) and afterwards
    (shape propagation of the whole graph). Values are memoised per node and
    also stored as torch's node.meta["val"]; FLOPs of nodes that must be run
    to be counted (flops.needs_running) are kept in `counted`.

    Repeated layers cost one evaluation: calls are answered by a
    `CallCache` (ptc.compiler.graph.call_cache), so layers 1..L-1 of identical
    blocks reuse the evaluations of layer 0, FLOP counts included.
    """

    def __init__(self, root: nn.Module, inputs: dict[str, torch.Tensor]):
        self.root = root
        self.inputs = inputs
        self.memo: dict[fx.Node, object] = {}
        self.counted: dict[fx.Node, int] = {}
        self._cache = CallCache(root)

    def value(self, node: fx.Node):
        """The value of `node`, evaluating whatever it depends on first."""
        memo = self.memo
        if node in memo:
            return memo[node]
        todo = [node]
        with torch.no_grad():  # shapes only: no autograd graph between meta tensors
            self._drain(todo)
        return memo[node]

    def _drain(self, todo: list) -> None:
        memo = self.memo
        while todo:  # iterative post-order: graphs are thousands of nodes deep
            n = todo[-1]
            if n in memo:
                todo.pop()
                continue
            missing = [a for a in _reads(n) if a not in memo]
            if missing:
                todo.extend(missing)
                continue
            memo[n] = self._run(n)
            n.meta["val"] = memo[n]
            todo.pop()

    def run_all(self, graph: fx.Graph) -> None:
        """Evaluate every node of the graph (in order, so no deep searches)."""
        for n in graph.nodes:
            if n.op != "output":
                self.value(n)

    def forget(self, node: fx.Node) -> None:
        """Drop a node's value (it was erased or rewritten)."""
        self.memo.pop(node, None)
        self.counted.pop(node, None)

    def _run(self, node: fx.Node):
        op = node.op
        if op == "placeholder":
            if node.target in self.inputs:
                return self.inputs[node.target]
            return node.args[0] if node.args else None  # a concrete arg's default
        if op == "get_attr":
            return operator.attrgetter(node.target)(self.root)
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), self.memo.__getitem__)
        if op == "output":
            return args[0] if args else None
        try:
            fn, count = self._callable(node)
            out, flops = self._cache.call(node, args, kwargs,
                                          lambda: _call(fn, count, args, kwargs))
            if flops is not None:
                self.counted[node] = flops
            return out
        except DataDependent:
            raise
        except Exception as exc:
            raise NodeFailed(node, exc) from exc

    def _callable(self, node: fx.Node):
        """(function to call with the node's evaluated args, whether to count its FLOPs)."""
        if node.op == "call_module":
            mod = self.root.get_submodule(node.target)
            return mod, nodes.module_kind(type(mod)) == "other"
        if node.op == "call_method":
            return (lambda obj, *a, **k: getattr(obj, node.target)(*a, **k)), False
        return node.target, nodes.op_name(node) == "einsum"


def _reads(node: fx.Node) -> list[fx.Node]:
    """The nodes `node`'s value depends on: its inputs, and the calls before it that write
    into one of them (after `x.unsqueeze_(0)`, every later reader of x sees [1, ...])."""
    inputs = node.all_input_nodes
    writers = [user for a in inputs for user in a.users
               if user is not node and user < node and changes_operands(user)]
    return [*inputs, *writers]


def _call(fn, count: bool, args: tuple, kwargs: dict) -> tuple[object, int | None]:
    """fn's result on meta tensors, and its FLOPs when they must be counted by running it."""
    if count:
        return flops_mod.count_flops(fn, *args, **kwargs)
    return fn(*args, **kwargs), None


class NodeFailed(RuntimeError):
    """Evaluating a node on meta tensors raised."""

    def __init__(self, node: fx.Node, exc: Exception):
        self.node, self.exc = node, exc
        super().__init__(f"evaluating node {node.name} ({node.op} {node.target}) on meta "
                         f"tensors failed: {type(exc).__name__}: {exc}")


class DataDependent(Exception):
    """Control flow on tensor values met while tracing."""

    def __init__(self, module: tuple[str, str] | None, frame: tuple[str, int, str] | None):
        self.module, self.frame = module, frame
        super().__init__("control flow depends on tensor values")
