"""Reuse of meta evaluations: a call on meta tensors is decided by its signature.

On the meta device an op's result (its shapes, dtypes and strides) depends
only on what it calls and on its operands' metadata and constants, never on
values. Identical transformer layers make the same calls on operands of the
same metadata, so evaluating layer 0 answers layers 1 .. L-1, and compile
cost stays flat in depth. Layers that differ (another width, more heads, an
eps) differ in some signature and are evaluated themselves.

Terms:
- a value's *signature*: a tensor's (shape, dtype, strides, device type,
  requires_grad); a scalar's type and value (1, 1.0 and True differ);
  containers' element by element, with their type. Any other value has
  none, and a call that reads it is not cached;
- a module's signature: its class, training flag, simple configuration
  attributes (an unknown one by identity: equal only to itself), its
  parameters' and buffers' signatures, and its children's, recursively;
  a module with forward hooks has none (a hook may do anything). A
  GraphModule's is its graph's: per node its op, what it calls (for an
  attribute read, the attribute's signature) and its operands (earlier
  nodes by position, constants by signature), so the checkpoint regions of
  identical layers, whose nodes differ only in names, are one signature;
- a call's *key*: what it calls (a function, a method name, or a module's
  signature) and its arguments' signatures. In-place calls and calls with
  an `out=` tensor have no key: their result is an operand they change.
  Only results made of tensors and scalars are reused; any other object
  returned (a handle) belongs to the call that made it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import fx, nn
from torch.utils._pytree import tree_map

from ptc.compiler.graph.meta import get_info

_SCALARS = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)
_MISSING = object()


class Unkeyable(Exception):
    """A value, module or call that has no signature."""


def changes_operands(node: fx.Node) -> bool:
    """Whether the node's call writes into an operand: an in-place call or an `out=` tensor."""
    if "out" in node.kwargs:
        return True
    if node.op == "call_method":
        return _in_place_name(node.target)
    return node.op == "call_function" and _mutates(node.target)


class CallCache:
    """Results of the calls of graph nodes on meta tensors, by the calls' keys."""

    def __init__(self, root: nn.Module):
        self.root = root
        """The module whose submodules `call_module` nodes name."""
        self._results: dict[tuple, object] = {}
        self._module_sigs: dict[int, tuple] = {}

    def for_root(self, root: nn.Module) -> CallCache:
        """A cache for the graph of another root module that shares these results.

        A call's result depends on its key alone, so what one graph's evaluation
        found answers another's (the same graph after a pass, another stage).
        """
        other = CallCache(root)
        other._results = self._results
        return other

    def call(self, node: fx.Node, args: tuple, kwargs: dict, run: Callable[[], object]):
        """run()'s result, or a copy of the result of an earlier call of the same key.

        `args`/`kwargs` are the node's evaluated operands; `run` makes the
        call. Each caller gets tensors of its own, so an in-place change to
        metadata (unsqueeze_) on one node's value never reaches another's.
        """
        key = self.key(node, args, kwargs)
        if key is None:
            return run()
        hit = self._results.get(key, _MISSING)
        if hit is not _MISSING:
            return fresh_tree(hit)
        out = run()
        if _copyable(out):
            self._results[key] = fresh_tree(out)
        return out

    def key(self, node: fx.Node, args: tuple, kwargs: dict) -> tuple | None:
        """The key of the node's call with these operands; None when it must not be cached."""
        try:
            if "out" in kwargs or changes_operands(node):
                return None
            if node.op == "call_module":
                head = ("M", self._module_sig(self.root.get_submodule(str(node.target))))
            elif node.op in ("call_method", "call_function"):
                head = ("C" if node.op == "call_method" else "F", node.target)
            else:
                return None
            return head + (signature(args), signature(kwargs))
        except Unkeyable:
            return None

    def _module_sig(self, mod: nn.Module) -> tuple:
        sig = self._module_sigs.get(id(mod))
        if sig is None:
            sig = module_signature(mod)
            self._module_sigs[id(mod)] = sig
        return sig


def signature(x) -> tuple:
    """Hashable description of a value (module docstring); raises Unkeyable for none."""
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.dtype, x.stride(), x.device.type, x.requires_grad)
    if x is None or isinstance(x, _SCALARS):
        return (type(x), x)
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(signature(v) for v in x))
    if isinstance(x, dict):
        return (type(x), tuple((k, signature(v)) for k, v in x.items()))
    if isinstance(x, slice):
        return (slice, signature(x.start), signature(x.stop), signature(x.step))
    if isinstance(x, nn.Module):
        return ("M", module_signature(x))
    raise Unkeyable(type(x).__name__)


def module_signature(mod: nn.Module) -> tuple:
    """Hashable description of a module (module docstring); raises Unkeyable for none."""
    if mod._forward_hooks or mod._forward_pre_hooks:
        raise Unkeyable(f"{type(mod).__name__} has forward hooks")
    if isinstance(mod, fx.GraphModule):
        return ("G", mod.training, _graph_signature(mod))
    config = []
    for name, value in sorted(vars(mod).items()):
        if name.startswith("_") or name == "training":
            continue
        try:
            config.append((name, signature(value)))
        except Unkeyable:
            config.append((name, id(value)))
    tensors = tuple((n, signature(t)) for n, t in (*mod._parameters.items(),
                                                    *mod._buffers.items()))
    children = tuple((n, module_signature(c)) for n, c in mod.named_children())
    return (type(mod), mod.training, tuple(config), tensors, children)


def _graph_signature(gm: fx.GraphModule) -> tuple:
    """Per node: op, what it calls and its operands, nodes by position (module docstring)."""
    position: dict[fx.Node, int] = {}
    rows = []
    for i, node in enumerate(gm.graph.nodes):
        position[node] = i
        # A placeholder's name differs from layer to layer; its value is an operand.
        target = None if node.op == "placeholder" else _target_signature(gm, node)
        rows.append((node.op, target, _operands(node.args, position),
                     _operands(node.kwargs, position)))
    return tuple(rows)


def nodes_signature(gm: fx.GraphModule, nodes: list[fx.Node]) -> tuple:
    """`_graph_signature` of a run of `gm`'s nodes (a layer): an operand made outside the
    run by its recorded shapes and dtypes. Two runs of one signature make the same calls on
    operands alike (raises Unkeyable for a node or operand that has none)."""
    position = {node: i for i, node in enumerate(nodes)}
    rows = []
    for node in nodes:
        if node.op in ("placeholder", "output"):
            raise Unkeyable(node.op)
        outside = {a: ("X", *_recorded(get_info(a))) for a in node.all_input_nodes
                   if a not in position}
        rows.append((node.op, _target_signature(gm, node),
                     _operands(node.args, position, outside),
                     _operands(node.kwargs, position, outside)))
    return tuple(rows)


def _target_signature(gm: fx.GraphModule, node: fx.Node):
    """What a node calls: an attribute by its value's signature, a module by its own, a
    function or method by itself."""
    if node.op == "get_attr":
        return signature(operator.attrgetter(str(node.target))(gm))
    if node.op == "call_module":
        return module_signature(gm.get_submodule(str(node.target)))
    return node.target


def _recorded(info) -> tuple:
    if info is None or not info.shapes:
        raise Unkeyable("an operand with no recorded shape")
    return tuple(map(tuple, info.shapes)), tuple(info.dtypes)


def _operands(value, position: dict[fx.Node, int], outside: dict | None = None):
    """`value` with nodes by their position (or as `outside` describes them) and other
    values by their signature."""
    if isinstance(value, fx.Node):
        return ("N", position[value]) if value in position else outside[value]
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_operands(v, position, outside) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _operands(v, position, outside)) for k, v in value.items()))
    return signature(value)


def _mutates(target) -> bool:
    """Whether a call_function target changes an operand in place (aten schema, or a name_)."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    return _in_place_name(getattr(target, "__name__", ""))


def _in_place_name(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__")


def _copyable(value) -> bool:
    """Whether a result can be handed out again as copies: tensors, scalars and containers
    of them. Any other object (a handle to a collective in flight) is one caller's own."""
    try:
        signature(value)
    except Unkeyable:
        return False
    return True


def fresh_tree(value):
    """`value` with every tensor in it replaced by a new one of the same metadata."""
    if isinstance(value, torch.Tensor):
        return _fresh(value)
    if value is None or isinstance(value, (*_SCALARS, torch.Size)):  # nothing to replace
        return value
    if type(value) in (tuple, list):  # the common containers, without pytree's dispatch
        return type(value)(fresh_tree(v) for v in value)
    return tree_map(_fresh, value)


def _fresh(x):
    """A new meta tensor with x's metadata; other values as they are."""
    if isinstance(x, torch.Tensor):
        out = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
        return out.requires_grad_() if x.requires_grad else out
    return x
