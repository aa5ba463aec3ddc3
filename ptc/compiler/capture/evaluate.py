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

import torch
from torch import fx, nn
from torch.utils._pytree import tree_map

from ptc.compiler import flops as flops_mod
from ptc.compiler import nodes


class Evaluator:
    """Computes node values on meta tensors, each node once, in any order.

    Used while tracing (to decide shape-dependent branches) and afterwards
    (shape propagation of the whole graph). Values are memoised per node and
    also stored as torch's node.meta["val"]; FLOPs of nodes that must be run
    to be counted (flops.needs_running) are kept in `counted`.

    Repeated layers cost one evaluation: a meta op's output depends only on
    the op and its operands' metadata, so results are cached under (op,
    operand shapes/dtypes/strides, constants) — for a leaf module, its class,
    configuration and parameter shapes. Layer 1..L-1 of identical blocks hit
    the cache of layer 0. In-place ops are never cached.
    """

    def __init__(self, root: nn.Module, inputs: dict[str, torch.Tensor]):
        self.root = root
        self.inputs = inputs
        self.memo: dict[fx.Node, object] = {}
        self.counted: dict[fx.Node, int] = {}
        self._cache: dict[tuple, tuple[object, int | None]] = {}
        self._module_sigs: dict[int, tuple] = {}

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
            missing = [a for a in n.all_input_nodes if a not in memo]
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
            return _fetch(self.root, node.target)
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), self.memo.__getitem__)
        if op == "output":
            return args[0] if args else None
        try:
            fn, count = self._callable(node)
            key = self._key(node, fn, args, kwargs)
            if key is not None and key in self._cache:
                out, flops = self._cache[key]
                out = tree_map(_fresh, out)
            elif count:
                out, flops = flops_mod.count_flops(fn, *args, **kwargs)
            else:
                out, flops = fn(*args, **kwargs), None
            if key is not None and key not in self._cache:
                self._cache[key] = (tree_map(_fresh, out), flops)
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

    def _key(self, node: fx.Node, fn, args, kwargs) -> tuple | None:
        """Cache key of a call, or None when it must not be cached (in-place, odd args)."""
        try:
            if node.op == "call_module":
                head = ("M", self._module_sig(fn))
            elif node.op == "call_method":
                if node.target.endswith("_") and not node.target.endswith("__"):
                    return None
                head = ("C", node.target)
            else:
                if _mutates(node.target):
                    return None
                head = ("F", node.target)
            return head + (_sig(args), _sig(kwargs))
        except _Unhashable:
            return None

    def _module_sig(self, mod: nn.Module) -> tuple:
        sig = self._module_sigs.get(id(mod))
        if sig is None:
            sig = _module_signature(mod)
            self._module_sigs[id(mod)] = sig
        return sig


class _Unhashable(Exception):
    """A value that cannot be part of a cache key."""


_SCALARS = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _sig(x):
    """Hashable description of a value: tensors by metadata, containers element-wise."""
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.dtype, x.stride(), x.device.type)
    if x is None or isinstance(x, _SCALARS):
        return (type(x), x)  # 1, 1.0 and True hash alike but type differently
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(_sig(v) for v in x))
    if isinstance(x, dict):
        return (dict, tuple((k, _sig(v)) for k, v in x.items()))
    if isinstance(x, slice):
        return (slice, _sig(x.start), _sig(x.stop), _sig(x.step))
    raise _Unhashable(type(x).__name__)


def _fresh(x):
    """A new meta tensor like x, so that nodes sharing a cached result never share
    a tensor object (an in-place unsqueeze_ on one must not reshape the other)."""
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
    return x


def _module_signature(mod: nn.Module) -> tuple:
    """Class, simple configuration attributes, tensors' metadata, and children, recursively."""
    config = []
    for name, value in sorted(vars(mod).items()):
        if name.startswith("_") or name == "training":
            continue
        try:
            config.append((name, _sig(value)))
        except _Unhashable:
            config.append((name, id(value)))  # unknown config: equal only to itself
    tensors = tuple((n, _sig(t)) for n, t in (*mod._parameters.items(), *mod._buffers.items()))
    children = tuple((n, _module_signature(c)) for n, c in mod.named_children())
    return (type(mod), mod.training, tuple(config), tensors, children)


def _mutates(target) -> bool:
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    name = getattr(target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def _fetch(root: nn.Module, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


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
