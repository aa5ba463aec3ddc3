"""Capture a model as one annotated fx graph on the meta device.

Two front doors, one IR (see DESIGN.md):

1. **fx** — `torch.fx.symbolic_trace` with a tracer that keeps torch.nn
   modules (Linear, Embedding, norms, dropout, activations) as leaves. When
   the model branches on a *shape* (`if x.size(1) > 1`, `assert t <=
   block_size`), the tracer evaluates the condition on meta tensors and
   follows the branch taken at the captured (micro_batch, seq_len), just as
   torch.export specialises. A branch on tensor *values* (`if x.sum() > 0`)
   cannot be captured; that is reported at once with the module and line.
2. **export** — when symbolic tracing fails for another reason (Python that
   needs a concrete value: `torch.finfo(x.dtype)`, `int(x.size(1))`, ...),
   `torch.export.export` (non-strict) gives an aten graph whose nodes carry
   their module in `nn_module_stack`.

Both run on a meta copy of the model in the compute dtype, so no weight is
ever allocated. The graph is then normalised (placeholders `tokens` and, with
a loss, `targets`; one output), shape-propagated on meta tensors, and every
node annotated once with a `NodeInfo` (ptc.compiler.meta).

How forward is called (the calling rule):
- the first parameter of forward receives tokens[b, s] (int64);
- a parameter named `targets`, `labels`, `target` or `y` receives the targets
  whenever the model has one — even without a loss — because models such as
  nanoGPT compute full-sequence logits only when given targets;
- `use_cache`, `output_attentions`, `output_hidden_states` are set False;
  every other parameter keeps its default (e.g. `attention_mask=None`,
  `past_key_values=None`); a parameter without default is an error.

How the output is read (the output rule): the logits are the output named
"logits", else the floating [b, s, V] tensor (largest V); the model's loss is
the output named "loss", else its 0-d floating tensor. With `with_loss`, the
graph returns the model's own loss when forward took targets, else the mean
cross-entropy of logits[b·s, V] against targets[b·s] appended to the graph
(module path "", so every other node keeps the user's module path).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import io
import logging
import os
import re
import sys
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.nn import functional as F
from torch.utils._pytree import tree_leaves, tree_map, tree_unflatten

from ptc.compiler import flops as flops_mod
from ptc.compiler import nodes
from ptc.compiler.meta import CaptureInfo, GraphRecord, NodeInfo, set_graph_record, set_info
from ptc.errors import CaptureError

TARGET_NAMES = ("targets", "labels", "target", "y")
FLAG_OVERRIDES = {"use_cache": False, "output_attentions": False,
                  "output_hidden_states": False}
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}

_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(os.path.abspath(__file__))
# Nodes that only re-check what capture already specialised (concrete args,
# export's input guards); they would pin the graph to no purpose.
_CHECK_FUNCTIONS = {torch._assert, fx._symbolic_trace._assert_is_none}
_CHECK_OPS = {"_assert_tensor_metadata", "_assert_scalar", "_assert_async",
              "sym_constrain_range", "sym_constrain_range_for_size"}


def capture(model: nn.Module, *, micro_batch: int, seq_len: int,
            dtype: torch.dtype | str = torch.float32, with_loss: bool = True,
            leaf_modules: tuple = (), front_door: str = "auto") -> fx.GraphModule:
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
    Raises CaptureError, naming the module and source line, when neither
    front door can capture the model.
    """
    if front_door not in ("auto", "fx", "export"):
        raise ValueError(f"front_door must be 'auto', 'fx' or 'export', got {front_door!r}")
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    call = _call_rule(model)
    root = _meta_model(model, dtype)
    inputs = {call.tokens: torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")}
    if call.targets:
        inputs[call.targets] = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")
    door, graph, evaluator, owner, out_spec = _open_a_door(model, root, call, inputs,
                                                           leaf_modules, front_door)
    graph.owning_module = owner  # DCE's purity check looks modules up (GraphModule resets it)
    try:
        vocab, model_loss = _normalise_io(graph, call, evaluator, out_spec, micro_batch,
                                          seq_len, with_loss, aten=door == "export",
                                          model_name=type(model).__name__)
    except _NodeFailed as failed:
        raise CaptureError(_meta_failure_message(model, failed)) from failed.exc
    gm = fx.GraphModule(owner, graph, type(model).__name__)
    blocks, num_layers = find_blocks(root)
    set_graph_record(gm, GraphRecord(capture=CaptureInfo(
        front_door=door, model_class=type(model).__name__, micro_batch=micro_batch,
        seq_len=seq_len, dtype=dtype, with_loss=with_loss, model_loss=model_loss,
        blocks_path=blocks, num_layers=num_layers, vocab=vocab)))
    _annotate(gm, root, evaluator, blocks, dtype)
    return gm


def _open_a_door(model, root, call, inputs, leaf_modules, front_door):
    """(door, graph, evaluator, owner, out_spec) from fx, else export; CaptureError if neither."""
    fx_exc = None
    if front_door != "export":
        try:
            return ("fx", *_fx_door(root, call, inputs, leaf_modules))
        except _DataDependent as dd:  # no door can capture this: say so at once
            raise CaptureError(_data_dependent_message(model, dd)) from None
        except Exception as exc:  # anything symbolic tracing cannot do: try the other door
            if front_door == "fx":
                raise CaptureError(_untraceable_message(model, root, exc, None)) from exc
            fx_exc = exc
    try:
        return ("export", *_export_door(root, call, inputs))
    except Exception as ex_exc:
        raise CaptureError(_untraceable_message(model, root, fx_exc, ex_exc)) from ex_exc


# ------------------------------------------------------------ calling rule


@dataclass
class _CallRule:
    tokens: str
    targets: str | None
    concrete: dict = field(default_factory=dict)
    """Every other forward parameter, with the value it is fixed to."""


def _call_rule(model: nn.Module) -> _CallRule:
    params = [p for p in inspect.signature(model.forward).parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not params:
        raise CaptureError(f"{type(model).__name__}.forward takes no argument; capture "
                           "calls forward(tokens[b, s]) (and targets, if it takes them)")
    targets = next((p.name for p in params[1:] if p.name in TARGET_NAMES), None)
    concrete = {}
    for p in params[1:]:
        if p.name == targets:
            continue
        if p.name in FLAG_OVERRIDES:
            concrete[p.name] = FLAG_OVERRIDES[p.name]
        elif p.default is not p.empty:
            concrete[p.name] = p.default
        else:
            raise CaptureError(
                f"{type(model).__name__}.forward needs argument {p.name!r}, which capture "
                f"cannot supply: it calls forward(tokens[, {'/'.join(TARGET_NAMES)}]). "
                f"Give {p.name!r} a default, or wrap the model in a module whose forward "
                "takes tokens")
    return _CallRule(params[0].name, targets, concrete)


# -------------------------------------------------------------- meta model


def _meta_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The model itself if it is all meta in `dtype`, else a meta copy of it.

    The copy is a deepcopy whose memo maps every parameter and buffer to an
    empty meta tensor (floating ones in `dtype`), so no weight is copied and
    tied parameters stay tied.
    """
    tensors = [t for m in model.modules()
               for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]
    if all(t.device.type == "meta" and (not t.is_floating_point() or t.dtype == dtype)
           for t in tensors):
        return model
    memo: dict = {}
    for m in model.modules():
        for store, is_param in ((m._parameters, True), (m._buffers, False)):
            for t in store.values():
                if t is None or id(t) in memo:
                    continue
                empty = torch.empty_like(t, device="meta",
                                         dtype=dtype if t.is_floating_point() else t.dtype)
                memo[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) \
                    if is_param else empty
    return copy.deepcopy(model, memo)


def find_blocks(model: nn.Module) -> tuple[str | None, int]:
    """(path, count) of the model's repeated blocks: the ModuleList/Sequential
    of same-class children holding the most parameters; (None, 0) if none."""
    best = None
    for path, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) == 0 or not path:
            continue
        children = list(mod.named_children())
        if len({type(c) for _, c in children}) != 1 or not all(n.isdigit() for n, _ in children):
            continue
        key = (sum(p.numel() for p in mod.parameters()), len(children))
        if best is None or key > best[0]:
            best = (key, path, len(children))
    return (best[1], best[2]) if best else (None, 0)


def layer_index(path: str, blocks: str | None) -> int | None:
    """Index of the block a module path lies in ("layers.3.attn" -> 3), else None."""
    if not blocks or not path.startswith(blocks + "."):
        return None
    head = path[len(blocks) + 1:].split(".", 1)[0]
    return int(head) if head.isdigit() else None


# --------------------------------------------------------------- evaluator


class _Evaluator:
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
        except _DataDependent:
            raise
        except Exception as exc:
            raise _NodeFailed(node, exc) from exc

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


class _NodeFailed(RuntimeError):
    """Evaluating a node on meta tensors raised."""

    def __init__(self, node: fx.Node, exc: Exception):
        self.node, self.exc = node, exc
        super().__init__(f"evaluating node {node.name} ({node.op} {node.target}) on meta "
                         f"tensors failed: {type(exc).__name__}: {exc}")


# ----------------------------------------------------------------- fx door


class _DataDependent(Exception):
    """Control flow on tensor values met while tracing."""

    def __init__(self, module: tuple[str, str] | None, frame: tuple[str, int, str] | None):
        self.module, self.frame = module, frame
        super().__init__("control flow depends on tensor values")


class _Tracer(fx.Tracer):
    """A symbolic tracer that resolves shape-dependent branches on meta tensors."""

    def __init__(self, evaluator: _Evaluator, leaf_modules: tuple):
        super().__init__()
        # Buffers come back as proxies (get_attr nodes), so `self.cos[:s]`
        # with a traced s is recorded rather than evaluated.
        self.proxy_buffer_attributes = True
        self.evaluator = evaluator
        self.leaf_types = tuple(m for m in leaf_modules if isinstance(m, type))
        self.leaf_globs = tuple(m for m in leaf_modules if isinstance(m, str))
        self._tensor_names: dict[int, str] | None = None

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        """Create a node and record the user source line that made it.

        fx's own `record_stack_traces` formats the whole stack for every node
        (a third of the time of tracing a 70B model); the innermost user frame
        is all capture and error messages need.
        """
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        frame = _user_frame(sys._getframe(1), with_text=False)
        if frame is not None:
            node.stack_trace = f'File "{frame[0]}", line {frame[1]}, in {frame[2]}'
        return node

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        """Parameters and buffers become get_attr proxies, found by identity.

        fx scans every named parameter/buffer of the model for each access;
        capture looks the name up in a table built once.
        """
        if not isinstance(attr_val, torch.Tensor):
            return attr_val
        if self._tensor_names is None:
            names: dict[int, str] = {}
            for name, t in (*self.root.named_buffers(), *self.root.named_parameters()):
                names.setdefault(id(t), name)
            self._tensor_names = names
        name = self._tensor_names.get(id(attr_val))
        if name is None:
            return attr_val
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        """torch.nn modules and those the caller named are leaves."""
        import fnmatch  # noqa: PLC0415 - only for the rare leaf globs

        if isinstance(m, self.leaf_types) or any(fnmatch.fnmatch(qualname, g)
                                                 for g in self.leaf_globs):
            return True
        return super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        """Trace a module call; remember the innermost module a failure came from."""
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as exc:
            if not hasattr(exc, "_ptc_module"):
                try:
                    exc._ptc_module = (self.path_of_module(m), type(m).__name__)
                except Exception:  # noqa: BLE001 - an exception that refuses attributes
                    pass
            raise

    def to_bool(self, obj: fx.Proxy) -> bool:
        """Decide a branch on a traced value: concrete for shapes, an error for data."""
        try:
            # fx patches nn.Module.__call__ while tracing; evaluating module
            # calls on real meta tensors must not be traced themselves.
            with fx._symbolic_trace._maybe_revert_all_patches():
                value = self.evaluator.value(obj.node)
        except _NodeFailed as failed:
            raise fx.proxy.TraceError(
                f"cannot decide a branch: {failed}") from failed.exc
        if isinstance(value, torch.Tensor):
            module = None
            if self.module_stack:
                path, cls = next(reversed(self.module_stack.values()))
                module = (path, nodes.class_name(cls))
            raise _DataDependent(module, _user_frame(sys._getframe(1)))
        return bool(value)


def _fx_door(root: nn.Module, call: _CallRule, inputs: dict, leaf_modules: tuple):
    """(graph, evaluator, module owning the graph's targets, None) by symbolic tracing."""
    evaluator = _Evaluator(root, inputs)
    tracer = _Tracer(evaluator, leaf_modules)
    graph = tracer.trace(root, concrete_args=dict(call.concrete))
    return graph, evaluator, tracer.root, None


# ------------------------------------------------------------- export door


def _export_door(root: nn.Module, call: _CallRule, inputs: dict):
    """(graph, evaluator, module owning the graph's targets, output pytree spec) by torch.export."""
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
    return graph, _Evaluator(unlifted, inputs), unlifted, out_spec


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


# ------------------------------------------------- inputs, outputs and loss


def _is_check(node: fx.Node) -> bool:
    if node.op == "call_module":
        return str(node.target).startswith("_guards_fn")
    if node.op != "call_function":
        return False
    if node.target in _CHECK_FUNCTIONS:
        return True
    return isinstance(node.target, torch._ops.OpOverload) and node.target._opname in _CHECK_OPS


def _normalise_io(graph: fx.Graph, call: _CallRule, evaluator: _Evaluator, out_spec,
                  b: int, s: int, with_loss: bool, aten: bool,
                  model_name: str) -> tuple[int | None, bool]:
    """Make the graph take (tokens[, targets]) and return logits or the loss.

    Returns (vocab, whether the loss is the model's own).
    """
    for node in reversed(list(graph.nodes)):
        if _is_check(node):
            graph.erase_node(node)
            evaluator.forget(node)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    tokens = next((n for n in placeholders if n.target == call.tokens), placeholders[0])
    targets = next((n for n in placeholders if call.targets and n.target == call.targets), None)
    out_node = graph.output_node()
    structure = out_node.args[0]
    if out_spec is not None:
        structure = tree_unflatten(list(structure), out_spec)
    logits, loss = _pick_outputs(structure, evaluator, b, s)
    model_loss = False
    if with_loss and loss is not None and targets is not None:
        result, model_loss = loss, True
    elif with_loss:
        if logits is None:
            raise CaptureError(_no_logits_message(model_name, structure, evaluator, b, s))
        if targets is None:
            with graph.inserting_after(tokens):
                targets = graph.placeholder("targets")
            evaluator.inputs["targets"] = torch.zeros(b, s, dtype=torch.long, device="meta")
        with graph.inserting_before(out_node):
            result = _append_loss(graph, logits, targets, evaluator.value(logits).shape[-1], aten)
    else:
        if logits is None:
            raise CaptureError(_no_logits_message(model_name, structure, evaluator, b, s))
        result = logits
    out_node.args = (result,)
    graph.eliminate_dead_code()
    for node in list(graph.nodes):
        if node.op == "placeholder" and node is not tokens and not node.users \
                and not (with_loss and node is targets):
            graph.erase_node(node)
    tokens.target = "tokens"
    if with_loss:
        targets.target = "targets"
    evaluator.memo = {n: v for n, v in evaluator.memo.items() if not n._erased}
    evaluator.inputs = {"tokens": evaluator.memo.get(tokens, evaluator.inputs[call.tokens]),
                        "targets": torch.zeros(b, s, dtype=torch.long, device="meta")}
    evaluator.run_all(graph)
    vocab = evaluator.value(logits).shape[-1] if logits is not None else None
    return vocab, model_loss


def _named_leaves(obj, name: str = ""):
    if isinstance(obj, fx.Node):
        yield name, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _named_leaves(value, str(key))
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            yield from _named_leaves(value, "")
    elif hasattr(obj, "__dataclass_fields__"):
        for key in obj.__dataclass_fields__:
            yield from _named_leaves(getattr(obj, key), key)


def _pick_outputs(structure, evaluator: _Evaluator, b: int, s: int):
    """(logits node, loss node) of the model's outputs (see the output rule)."""
    leaves = list(_named_leaves(structure))
    named = {name: node for name, node in leaves if name}
    vals = {node: evaluator.value(node) for _, node in leaves}

    def floating(node):
        return isinstance(vals[node], torch.Tensor) and vals[node].is_floating_point()

    logits = named.get("logits")
    if logits is None:
        candidates = [n for _, n in leaves if floating(n) and vals[n].dim() == 3
                      and tuple(vals[n].shape[:2]) == (b, s)]
        logits = max(candidates, key=lambda n: vals[n].shape[-1], default=None)
    loss = named.get("loss")
    if loss is None:
        loss = next((n for _, n in leaves if floating(n) and vals[n].dim() == 0), None)
    return logits, loss


def _append_loss(graph: fx.Graph, logits: fx.Node, targets: fx.Node, vocab: int,
                 aten: bool) -> fx.Node:
    """Append mean cross-entropy(logits[b·s, V], targets[b·s]) nodes; return the loss."""
    if aten:
        ops = torch.ops.aten
        flat = graph.call_function(ops.reshape.default, (logits, [-1, vocab]))
        flat_targets = graph.call_function(ops.reshape.default, (targets, [-1]))
        return graph.call_function(ops.cross_entropy_loss.default, (flat, flat_targets))
    flat = graph.call_method("reshape", (logits, -1, vocab))
    flat_targets = graph.call_method("reshape", (targets, -1))
    return graph.call_function(F.cross_entropy, (flat, flat_targets))


# --------------------------------------------------------------- annotate


_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def _source(node: fx.Node) -> str | None:
    """"file:line" of the innermost frame of the node's stack trace outside torch."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    found = [(p, n) for p, n in _FILE_LINE.findall(trace) if not _is_library(p)]
    if not found:
        return None
    path, line = found[-1]
    return f"{_short_path(path)}:{line}"


@functools.lru_cache(maxsize=256)
def _short_path(path: str) -> str:
    """`path` relative to the working directory when it lies below it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def _annotate(gm: fx.GraphModule, root: nn.Module, evaluator: _Evaluator,
              blocks: str | None, dtype: torch.dtype) -> None:
    """Attach a NodeInfo to every node (module path, layer, shapes, FLOPs, params)."""
    itemsize = dtype.itemsize
    param_cache: dict[str, int] = {}
    for node in gm.graph.nodes:
        kind = nodes.classify(node)
        path, mtype = _provenance(root, node)
        value = evaluator.memo.get(node)
        tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        if node in evaluator.counted:
            node_flops = evaluator.counted[node]
        elif node.op in ("call_function", "call_method", "call_module"):
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), evaluator.memo.__getitem__)
            node_flops = flops_mod.node_flops(node, kind, args, kwargs, value)
        else:
            node_flops = 0
        params = _params_read(gm, node, param_cache)
        set_info(node, NodeInfo(
            module_path=path, module_type=mtype, layer=layer_index(path, blocks), kind=kind,
            shapes=tuple(tuple(t.shape) for t in tensors),
            dtypes=tuple(t.dtype for t in tensors),
            flops=int(node_flops), params=params,
            param_bytes=params * itemsize if params else 0,
            source=_source(node)))


def _provenance(root: nn.Module, node: fx.Node) -> tuple[str, str]:
    """(module path, class name) of a node; classes looked up in the captured model
    (the graph module's own containers are plain Modules)."""
    if node.op in ("call_module", "get_attr"):
        path = str(node.target) if node.op == "call_module" else \
            str(node.target).rpartition(".")[0]
        try:
            return path, (type(root.get_submodule(path)).__name__ if path else "")
        except AttributeError:
            return path, ""
    path, cls = nodes.stack_entry(node)
    return (path, nodes.class_name(cls)) if path else ("", "")


def _params_read(gm: fx.GraphModule, node: fx.Node, cache: dict[str, int]) -> int:
    if node.op == "call_module":
        if node.target not in cache:
            cache[node.target] = sum(p.numel() for p in gm.get_submodule(node.target).parameters())
        return cache[node.target]
    if node.op == "get_attr":
        value = nodes.get_attr_value(node)
        return value.numel() if isinstance(value, nn.Parameter) else 0
    return 0


# ------------------------------------------------------------------ errors


def _is_library(filename: str) -> bool:
    return filename.startswith(_TORCH_DIR) or filename.startswith(_HERE) or \
        filename.startswith("<")


def _user_frame(frame, with_text: bool = True) -> tuple[str, int, str] | None:
    """(file, line, text) of the innermost frame outside torch and ptc.compiler.

    With `with_text` False the third item is the function name instead.
    """
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_library(filename):
            third = _line_text(filename, frame.f_lineno) if with_text else frame.f_code.co_name
            return filename, frame.f_lineno, third
        frame = frame.f_back
    return None


def _line_text(filename: str, lineno: int) -> str:
    import linecache  # noqa: PLC0415 - error path only

    return linecache.getline(filename, lineno).strip()


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
        if not _is_library(code.co_filename):
            frame = (code.co_filename, tb.tb_lineno, _line_text(code.co_filename, tb.tb_lineno))
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
        parts.append(f"at {_short_path(filename)}:{lineno}")
    text = " ".join(parts) or "at an unknown place"
    if frame and frame[2]:
        text += f"\n    {frame[2]}"
    return text


def _data_dependent_message(model: nn.Module, dd: _DataDependent) -> str:
    return (
        f"cannot capture {type(model).__name__}: Python control flow depends on tensor values "
        f"{_where(dd.module, dd.frame)}\n"
        "The graph would differ from batch to batch, so neither torch.fx nor torch.export "
        "can capture it. To make it capturable:\n"
        "  - remove the data-dependent branch: compute both sides and select with "
        "torch.where(cond, a, b), or use a mask;\n"
        "  - or express it with torch.cond (torch.export-friendly control flow).\n"
        "Branches on shapes and config flags (if x.size(1) > 1, if mask is not None) are fine.")


def _untraceable_message(model: nn.Module, root: nn.Module, fx_exc: BaseException | None,
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


def _meta_failure_message(model: nn.Module, failed: "_NodeFailed") -> str:
    src = _source(failed.node)
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


def _no_logits_message(model_name: str, structure, evaluator: _Evaluator, b: int,
                       s: int) -> str:
    found = []
    for name, node in _named_leaves(structure):
        value = evaluator.value(node)
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        found.append(f"{name or node.name}: {shape}")
    return (f"cannot find the logits among {model_name}'s outputs: capture needs a "
            f"floating tensor of shape [{b}, {s}, vocab] (or an output named 'logits'); "
            f"found {', '.join(found) or 'nothing'}")


# ------------------------------------------------------------ real weights


def with_weights(gm: fx.GraphModule, model: nn.Module) -> fx.GraphModule:
    """A runnable copy of a captured graph whose parameters and buffers are `model`'s.

    A graph is captured on meta; to run it (eager checks, tests) bind it to a
    materialised model with the same module paths: the new GraphModule looks
    every call_module / get_attr target up in `model`, so weights are shared,
    not copied, and non-persistent buffers (RoPE tables) come along. The
    graph, with its NodeInfo metadata, is copied; `gm` is left untouched.
    Compute happens in the dtype of `model`'s tensors. An export-door graph
    records the device of the tensors it creates (`arange(..., device=meta)`);
    those become the device of `model`'s parameters.
    """
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    meta = torch.device("meta")

    def on_device(arg):
        return device if isinstance(arg, torch.device) and arg == meta else arg

    graph = fx.Graph()
    val_map: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        new = graph.node_copy(node, val_map.__getitem__)
        new.args = fx.node.map_aggregate(new.args, on_device)
        new.kwargs = fx.node.map_aggregate(new.kwargs, on_device)
        val_map[node] = new
    bound = fx.GraphModule(model, graph, type(gm).__name__)
    bound.meta.update(gm.meta)
    return bound
