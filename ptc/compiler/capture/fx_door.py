"""The fx door: capture by `torch.fx.symbolic_trace`.

Terms: the *tracer* keeps torch.nn modules (Linear, Embedding, norms,
dropout, activations) and the caller's `leaf_modules` as *leaves*, single
call_module nodes. A *branch on a shape* (`if x.size(1) > 1`, `assert t <=
block_size`) is decided by evaluating the condition on meta tensors and
following the branch taken at the captured (micro_batch, seq_len), just as
torch.export specialises. A *branch on tensor values* (`if x.sum() > 0`)
cannot be captured by either door; it raises `DataDependent` at once, with
the module and line.

Job: trace the meta model into an fx graph of torch-level calls, with the
user's source line on every node.
"""

from __future__ import annotations

import dis
import functools
import sys
from bisect import bisect_left

import torch
from torch import fx, nn

from ptc.compiler.graph import nodes
from ptc.compiler.capture.annotate import user_frame
from ptc.compiler.capture.call import CallRule
from ptc.compiler.capture.evaluate import DataDependent, Evaluator, NodeFailed


class _Unpacking:
    """fx's proxy iteration (`b, s, _ = x.shape`), reading each function's bytecode once.

    fx decides how many values an unpacking takes from the calling frame's
    bytecode, which it disassembles whole at every iteration: three times a
    layer in a Llama, a tenth of tracing it. Here the instructions of a code
    object are listed once.
    """

    def __iter__(self):
        frame = sys._getframe(1)
        count = _unpacked_count(frame.f_code, frame.f_lasti)
        if count is not None:
            return (self[i] for i in range(count))
        return self.tracer.iter(self)


class _Proxy(_Unpacking, fx.Proxy):
    """A traced value whose attributes (`x.shape`) unpack as quickly."""

    def __getattr__(self, k):
        return _Attribute(self, k)


class _Attribute(_Unpacking, fx.proxy.Attribute):
    """A traced value's attribute, unpacked by `_Unpacking`."""


def _unpacked_count(code, last: int) -> int | None:
    """How many values the instruction at `last` of `code` unpacks; None when it does not."""
    instructions = _instructions(code)
    if sys.version_info >= (3, 11):
        index = bisect_left(instructions, last, key=lambda inst: inst.offset)
    else:
        index = last // 2
    inst = instructions[index]
    return inst.argval if inst.opname == "UNPACK_SEQUENCE" else None


@functools.lru_cache(maxsize=4096)
def _instructions(code) -> list:
    return list(dis.get_instructions(code))


class _Tracer(fx.Tracer):
    """A symbolic tracer that resolves shape-dependent branches on meta tensors."""

    def __init__(self, evaluator: Evaluator, leaf_modules: tuple):
        super().__init__()
        # Buffers come back as proxies (get_attr nodes), so `self.cos[:s]`
        # with a traced s is recorded rather than evaluated.
        self.proxy_buffer_attributes = True
        self.evaluator = evaluator
        self.leaf_types = tuple(m for m in leaf_modules if isinstance(m, type))
        self.leaf_globs = tuple(m for m in leaf_modules if isinstance(m, str))
        self._tensor_names: dict[int, str] | None = None

    def proxy(self, node: fx.Node) -> fx.Proxy:
        """fx's proxy, unpacked without disassembling the caller each time (`_Unpacking`)."""
        return _Proxy(node, self)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        """Create a node and record the user source line that made it.

        fx's own `record_stack_traces` formats the whole stack for every node
        (a third of the time of tracing a 70B model); the innermost user frame
        is all capture and error messages need.
        """
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        frame = user_frame(sys._getframe(1), with_text=False)
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
        except NodeFailed as failed:
            raise fx.proxy.TraceError(
                f"cannot decide a branch: {failed}") from failed.exc
        if isinstance(value, torch.Tensor):
            module = None
            if self.module_stack:
                path, cls = next(reversed(self.module_stack.values()))
                module = (path, nodes.class_name(cls))
            raise DataDependent(module, user_frame(sys._getframe(1)))
        return bool(value)


def fx_graph(root: nn.Module, call: CallRule, inputs: dict, leaf_modules: tuple):
    """(graph, evaluator, module owning the graph's targets, None) by symbolic tracing.

    The first door capture tries: its graph keeps the user's modules and
    torch-level calls. The None stands for the output pytree spec that only
    the export door has, so both doors answer alike.
    """
    evaluator = Evaluator(root, inputs)
    tracer = _Tracer(evaluator, leaf_modules)
    graph = tracer.trace(root, concrete_args=dict(call.concrete))
    return graph, evaluator, tracer.root, None
