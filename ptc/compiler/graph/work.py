"""What each graph node asks of the device, forward and backward, read off the graph on meta.

The captured graph is interpreted node by node on the meta device with
autograd on, and its loss differentiated, under a dispatch mode that sees
every aten op torch runs — the ones autograd's backward formulas run
included. Each op is charged to the graph node that made it: a forward op
to the node being interpreted, a backward op to the node whose forward
created the autograd node running it (`torch._C._current_autograd_node`).
No formula of ours guesses what a backward does.

Terms, per op (one aten call):
- *dispatched op*: every aten call, views included: what the host pays a
  dispatch for (`Work.ops`);
- *GEMM*: mm, addmm, bmm, baddbmm; its FLOPs 2·batch·m·n·k (`Work.gemm`);
  a grouped product of routed experts (`_grouped_mm`, transformers'
  fallback op) too: 2·m·n·k over its groups' rows (its weight gradient,
  whose operands are both rows, contracts each row once, not once per group);
- *attention kernel*: `scaled_dot_product_attention` without dropout runs as
  a fused flash kernel: forward 4·b·a·s_q·s_kv·d FLOPs (`flops.sdpa_flops`),
  half that where it is causal (`is_causal`: the kernel skips the tiles
  above the diagonal, `CAUSAL_SHARE`), backward 2.5 times the forward's — flash attention's backward runs five of the
  forward's two matrix products per tile, recomputing the scores (Dao 2023,
  FlashAttention-2, section 3.1.2) — and it reads and writes q, k, v, the
  output and its log-sum-exp once each way (`Work.attention`, bytes in
  `Work.memory`). With dropout it runs written out ("math"): its matrix
  products are GEMMs and its scale, mask, softmax and dropout are element-wise
  ops over the s × s scores;
- *dropout* runs as CUDA's fused kernel (as `ptc.compiler.graph.activations`
  counts it): it reads its input and writes its output and a 1-byte mask,
  and backward reads the gradient and the mask and writes one gradient (meta
  would run it as bernoulli, div and mul with a mask in the input's dtype);
- *memory-bound op*: any other op that is not a view: it moves the bytes of
  its tensor inputs and outputs (`Work.memory`), except that a lookup
  (embedding, index_select, gather, nll_loss) reads only the rows it gathers;
- *view*: an op whose output aliases its input (view, transpose, expand,
  split, detach, ...): no device work.

Fused kernels (`Work.fused_memory`, `Work.kernels`): a runtime that fuses
(torch.compile's inductor; Megatron-LM's and Transformer Engine's hand-fused
kernels: bias-GeLU, bias-dropout-add, fused LayerNorm/RMSNorm, scale-mask-
softmax, RoPE) runs each chain of memory-bound ops between two other kernels
(GEMMs, attention kernels, lookups) as one kernel. Such a kernel reads each
tensor made outside it once and writes each tensor it makes that anything
outside it reads — a later kernel, backward (what autograd saves), the step
(gradients) — or that nothing reads at all; what only its own ops read stays
in registers. Its bytes are charged to the ops that read and write them, one
kernel to its first op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ptc.compiler.graph.activations import DROPOUT_TARGETS, dropout_active
from ptc.compiler.graph.flops import sdpa_flops

CAUSAL_SHARE = 2
"""A causal flash kernel computes the tiles on and below the diagonal of the score matrix
and skips those above it: about half of its FLOPs (`Work.attention` divides by this)."""

FLASH_BACKWARD = 2.5
"""FLOPs of flash attention's backward over its forward's: five matrix products per tile
(the scores recomputed, dV, dP, dQ, dK) against the forward's two (Dao 2023,
FlashAttention-2, section 3.1.2)."""

_GEMMS = {"mm": 0, "addmm": 1, "bmm": 0, "baddbmm": 1, "_grouped_mm": 0,
          "grouped_mm_fallback": 0}
"""aten GEMM name -> index of its left operand in the call's arguments."""
_LOOKUPS = frozenset({"embedding", "index_select", "gather", "nll_loss_forward",
                      "nll_loss2d_forward"})
"""Ops that read only the rows they gather (plus the indices), not their whole table."""
_FREE = frozenset({"_unsafe_view", "_reshape_alias", "alias", "lift_fresh", "empty",
                   "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
"""Ops that move no data although their schema does not mark them as views."""
_SDPA = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)


@dataclass(slots=True)
class Work:
    """Device work of some ops: GEMM and attention FLOPs, bytes moved, ops dispatched."""

    gemm: float = 0.0
    """FLOPs of GEMMs."""
    attention: float = 0.0
    """FLOPs of fused attention kernels."""
    memory: float = 0.0
    """Bytes read and written by memory-bound ops and attention kernels."""
    ops: float = 0.0
    """aten ops dispatched, views included."""
    fused_memory: float = 0.0
    """`memory` with memory-bound ops run as fused kernels (module docstring)."""
    kernels: float = 0.0
    """Kernels launched with memory-bound ops fused (module docstring)."""

    def add(self, other: Work, scale: float = 1.0) -> None:
        """Add `other` (times `scale`) into this."""
        self.gemm += scale * other.gemm
        self.attention += scale * other.attention
        self.memory += scale * other.memory
        self.ops += scale * other.ops
        self.fused_memory += scale * other.fused_memory
        self.kernels += scale * other.kernels


@dataclass(frozen=True, slots=True)
class GemmCall:
    """One GEMM's shape: `batch` products of (m x k) @ (k x n), and which of its dimensions
    are a parameter's (`ptc.compiler.graph.gemm_tiles` prices the shape)."""

    batch: int
    m: int
    n: int
    k: int
    param: tuple[str, ...] = ()
    """The names of the parameter one operand is (a view of; a tied weight has several);
    empty when neither is."""
    param_dims: tuple[tuple[str, int], ...] = ()
    """(GEMM dimension, the parameter's dimension it is) for that operand's two."""


@dataclass(slots=True)
class NodeWork:
    """Forward and backward work charged to one graph node."""

    forward: Work = field(default_factory=Work)
    backward: Work = field(default_factory=Work)
    forward_gemms: list[GemmCall] = field(default_factory=list)
    """The GEMMs of `forward`, in the order they ran."""
    backward_gemms: list[GemmCall] = field(default_factory=list)
    """The GEMMs of `backward`, in the order they ran."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_view(func) -> bool:
    schema = func._schema
    name = schema.name.split("::")[-1]
    if name in _FREE or getattr(func, "is_view", False):
        return True
    returns = [r for r in schema.returns if r.alias_info is not None]
    return bool(returns) and all(not r.alias_info.is_write for r in returns)


def op_work(func, args: tuple, kwargs: dict, out) -> Work:
    """The work of one aten call (see the module docstring)."""
    name = func._schema.name.split("::")[-1]
    if _is_view(func):
        return Work(ops=1)
    if name in _GEMMS:
        left, right = args[_GEMMS[name]], args[_GEMMS[name] + 1]
        out_t = out if isinstance(out, torch.Tensor) else tree_leaves(out)[0]
        groups = out_t.shape[0] if left.dim() == right.dim() == 2 < out_t.dim() else 1
        return Work(gemm=2.0 * out_t.numel() * left.shape[-1] / groups, ops=1)
    tensors_in = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    tensors_out = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if name in _LOOKUPS:
        gathered = sum(_nbytes(t) for t in tensors_out)
        indices = sum(_nbytes(t) for t in tensors_in if not t.is_floating_point())
        return Work(memory=2.0 * gathered + indices, ops=1)
    return Work(memory=float(sum(_nbytes(t) for t in (*tensors_in, *tensors_out))), ops=1)


def gemm_call(func, args: tuple, params: dict[int, tuple[tuple[str, ...], torch.Tensor]]
              ) -> GemmCall:
    """The shape of one aten GEMM call; `params`: the model's parameters by storage, to
    tell which operand is a weight and how its dimensions map onto the GEMM's (by stride,
    which tells a weight from its transpose even when square)."""
    left = _GEMMS[func._schema.name.split("::")[-1]]
    a, b_ = args[left], args[left + 1]
    batch = a.shape[0] if a.dim() == 3 else 1
    call = GemmCall(batch=batch, m=a.shape[-2], n=b_.shape[-1], k=a.shape[-1])
    for operand, gemm_dims in ((a, ("m", "k")), (b_, ("k", "n"))):
        # A weight matrix, or a stack of experts' (each group's product reads one).
        found = params.get(operand.untyped_storage()._cdata) if operand.dim() in (2, 3) \
            else None
        if found is None:
            continue
        param_names, p = found
        dims = tuple((g, d) for g, size, stride in zip(gemm_dims, operand.shape[-2:],
                                                        operand.stride()[-2:])
                     for d in range(p.dim()) if p.shape[d] == size and p.stride(d) == stride)
        return dataclasses.replace(call, param=param_names, param_dims=dims)
    return call


@dataclass(slots=True)
class _Op:
    """One aten call as the fusion pass sees it."""

    work: Work
    """Its work as a kernel of its own; the fused figures are filled in by `_fuse`."""
    charge: Callable[[Work], None]
    """Adds work to what the op is charged to."""
    fusable: bool
    """A memory-bound op (not a view, GEMM, attention kernel or lookup)."""
    backward: bool
    reads: list[tuple[tuple, int]]
    """(version of a view of a storage, bytes) of each tensor input."""
    writes: list[tuple[tuple, int]]
    """(version of a storage, bytes) of each tensor output."""


class _Trace:
    """aten calls in the order they run, with the storage versions they read and write."""

    def __init__(self):
        self.ops: list[_Op] = []
        self.version: dict[int, int] = {}
        self.keep: list[torch.Tensor] = []  # keeps storages alive so their keys stay unique

    def _key(self, t: torch.Tensor) -> int:
        self.keep.append(t)
        return t.untyped_storage()._cdata

    def add(self, work: Work, charge, *, fusable: bool, backward: bool, inputs, outputs) -> None:
        """Record one kernel's call: its `inputs` read, then its `outputs` written."""
        reads = []
        for t in inputs:
            key = self._key(t)
            view = (key, self.version.get(key, 0), t.storage_offset(), tuple(t.shape),
                    tuple(t.stride()))
            reads.append((view, _nbytes(t)))
        writes = []
        for t in outputs:
            key = self._key(t)
            self.version[key] = self.version.get(key, 0) + 1
            writes.append(((key, self.version[key]), _nbytes(t)))
        self.ops.append(_Op(work, charge, fusable, backward, reads, writes))

    def finish(self) -> None:
        """Charge every op its work, with the fused figures (module docstring)."""
        groups: list[list[_Op]] = []
        for op in self.ops:
            if op.fusable and groups and groups[-1][0].fusable \
                    and groups[-1][0].backward == op.backward:
                groups[-1].append(op)
            else:
                groups.append([op])
        group_of: dict[tuple, int] = {}
        for i, group in enumerate(groups):
            for op in group:
                group_of.update((version, i) for version, _ in op.writes)
        readers: dict[tuple, set[int]] = {}
        for i, group in enumerate(groups):
            for op in group:
                for view, _ in op.reads:
                    readers.setdefault(view[:2], set()).add(i)
        for i, group in enumerate(groups):
            seen: set[tuple] = set()
            for k, op in enumerate(group):
                if not op.fusable:
                    op.work.fused_memory, op.work.kernels = op.work.memory, 1
                    op.charge(op.work)
                    continue
                moved = 0
                for view, nbytes in op.reads:  # made outside the kernel: read once
                    if group_of.get(view[:2]) != i and view not in seen:
                        seen.add(view)
                        moved += nbytes
                for version, nbytes in op.writes:  # read outside the kernel, or by nothing
                    if readers.get(version, {-1}) != {i}:
                        moved += nbytes
                op.work.fused_memory, op.work.kernels = moved, int(k == 0)
                op.charge(op.work)


def _fusable(func) -> bool:
    name = func._schema.name.split("::")[-1]
    return not _is_view(func) and name not in _GEMMS and name not in _LOOKUPS


class _Recorder(TorchDispatchMode):
    """Records every aten call in `trace`, charged to what `charge_to(phase)` names (None:
    left out, as autograd's accumulation of parameter gradients)."""

    def __init__(self, trace: _Trace,
                 charge_to: Callable[[str | None], Callable[[Work], None] | None],
                 gemm_to: Callable[[str | None], Callable[[GemmCall], None] | None]
                 = lambda phase: None,
                 params: dict[int, tuple[tuple[str, ...], torch.Tensor]] | None = None):
        super().__init__()
        self.trace, self.charge_to, self.gemm_to = trace, charge_to, gemm_to
        self.params = params or {}
        self.phase: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        charge = self.charge_to(self.phase)
        if charge is None:
            return out
        work = op_work(func, args, kwargs, out)
        if work.gemm and (record_gemm := self.gemm_to(self.phase)) is not None:
            record_gemm(gemm_call(func, args, self.params))
        if _is_view(func):
            work.fused_memory = 0.0
            charge(work)
            return out
        self.trace.add(work, charge, fusable=_fusable(func),
                       backward=torch._C._current_autograd_node() is not None,
                       inputs=[t for t in tree_leaves((args, kwargs))
                               if isinstance(t, torch.Tensor)],
                       outputs=[t for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out


class _FlashAttention(torch.autograd.Function):
    """Meta stand-in for a flash attention kernel: its output, and its work each way."""

    @staticmethod
    def forward(ctx, q, k, v, causal, record):  # noqa: D102 - autograd.Function protocol
        flops = sdpa_flops(q.shape, k.shape, v.shape)
        if causal and q.shape[-2] == k.shape[-2]:
            flops //= CAUSAL_SHARE
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = 4 * q.shape[:-1].numel()
        moved = _nbytes(q) + _nbytes(k) + _nbytes(v) + _nbytes(out)
        record(Work(attention=flops, memory=moved + lse, ops=1), "forward", (q, k, v), (out,))
        ctx.save_for_backward(q, k, v, out)
        ctx.work = Work(attention=FLASH_BACKWARD * flops, memory=2 * moved + lse, ops=1)
        ctx.record = record
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102 - autograd.Function protocol
        q, k, v, out = ctx.saved_tensors
        grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        ctx.record(ctx.work, "backward", (grad, q, k, v, out), grads)
        return *grads, None, None


class _FusedDropout(torch.autograd.Function):
    """Meta stand-in for CUDA's fused dropout (module docstring): a memory-bound kernel."""

    @staticmethod
    def forward(ctx, x, record):  # noqa: D102 - autograd.Function protocol
        out, mask = torch.empty_like(x), torch.empty(x.shape, dtype=torch.bool, device=x.device)
        record(Work(memory=2 * _nbytes(x) + _nbytes(mask), ops=1), "forward", (x,), (out, mask),
               fusable=True)
        ctx.save_for_backward(mask)
        ctx.record = record
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102 - autograd.Function protocol
        (mask,) = ctx.saved_tensors
        out = torch.empty_like(grad)
        ctx.record(Work(memory=2 * _nbytes(grad) + _nbytes(mask), ops=1), "backward",
                   (grad, mask), (out,), fusable=True)
        return out, None


class _WorkInterpreter(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, recorder: _Recorder, record_kernel):
        super().__init__(gm, garbage_collect_values=False)
        self.recorder, self.record_kernel = recorder, record_kernel
        self.current: str | None = None
        self.owner: dict[int, str] = {}  # autograd node sequence number -> graph node name

    def run_node(self, n: torch.fx.Node):
        self.current = n.name
        self.recorder.phase = "forward"
        try:
            out = super().run_node(n)
        finally:
            self.recorder.phase = None
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                self._claim(t.grad_fn, n.name)
        return out

    def _claim(self, fn, name: str) -> None:
        """Charge the autograd nodes `fn` reaches that no earlier graph node made to `name`."""
        stack = [fn]
        while stack:
            node = stack.pop()
            if node is None:
                continue
            if type(node).__name__ == "AccumulateGrad":
                continue
            seq = node._sequence_nr()
            if seq in self.owner:
                continue
            self.owner[seq] = name
            stack.extend(f for f, _ in node.next_functions)

    def _kernel_recorder(self):
        """Records a stand-in kernel's call, charged to the node being interpreted now."""
        name = self.current
        return lambda *args, **kwargs: self.record_kernel(name, *args, **kwargs)

    def call_function(self, target, args, kwargs):
        if target in _SDPA and _flash(args, kwargs):
            return _FlashAttention.apply(*args[:3], _asks_causal(args, kwargs),
                                         self._kernel_recorder())
        if target in DROPOUT_TARGETS and dropout_active(args, kwargs):
            return _FusedDropout.apply(args[0], self._kernel_recorder())
        return super().call_function(target, args, kwargs)

    def call_module(self, target, args, kwargs):
        mod = self.fetch_attr(target)
        if isinstance(mod, torch.nn.Dropout) and mod.training and mod.p > 0:
            return _FusedDropout.apply(args[0], self._kernel_recorder())
        return super().call_module(target, args, kwargs)


def _asks_causal(args: Sequence, kwargs: dict) -> bool:
    """Whether the attention call asks for the causal mask (`is_causal`)."""
    return bool(args[5] if len(args) > 5 else kwargs.get("is_causal", False))


def runs_causal_kernel(gm: torch.fx.GraphModule) -> bool:
    """Whether `gm`'s fused attention runs as a causal flash kernel (a
    scaled_dot_product_attention asking `is_causal`, without dropout), whose work
    `graph_work` counts at the half of the tiles it computes (`CAUSAL_SHARE`)."""
    return any(n.op == "call_function" and n.target in _SDPA and _flash(n.args, n.kwargs)
               and _asks_causal(n.args, n.kwargs) for n in gm.graph.nodes)


def _flash(args: Sequence, kwargs: dict) -> bool:
    """Whether the fused kernel runs it: no dropout (with dropout ptc writes it out)."""
    dropout = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
    return not dropout


def graph_work(gm: torch.fx.GraphModule, inputs: Sequence[torch.Tensor]) -> dict[str, NodeWork]:
    """Graph node name -> the work its forward and its backward ask of the device, for one
    micro-batch: `gm` (a captured graph returning the loss, parameters on meta) run on
    `inputs` (meta tensors) and differentiated. Backward ops outside any node's autograd
    nodes (the loss's seed gradient) are charged to the output node; autograd's own
    accumulation of parameter gradients is left out (the runtime accumulates into its
    gradient buffers instead, `ptc.runtime.grads`)."""
    works: dict[str, NodeWork] = {}
    output = next(n.name for n in reversed(gm.graph.nodes) if n.op == "output")
    interp: _WorkInterpreter

    def node_of_backward() -> str | None:
        an = torch._C._current_autograd_node()
        if an is None:
            return output
        if type(an).__name__ == "AccumulateGrad":
            return None
        return interp.owner.get(an._sequence_nr(), output)

    def to(name: str | None, phase: str | None) -> Callable[[Work], None] | None:
        if name is None:
            return None
        entry = works.setdefault(name, NodeWork())
        return (entry.forward if phase == "forward" else entry.backward).add

    def charged(phase: str | None) -> str | None:
        return (interp.current or output) if phase == "forward" else node_of_backward()

    def charge_to(phase: str | None) -> Callable[[Work], None] | None:
        return to(charged(phase), phase)

    def gemm_to(phase: str | None) -> Callable[[GemmCall], None] | None:
        name = charged(phase)
        if name is None:
            return None
        entry = works.setdefault(name, NodeWork())
        return (entry.forward_gemms if phase == "forward" else entry.backward_gemms).append

    def record_kernel(name: str, work: Work, phase: str, inputs, outputs, *,
                      fusable: bool = False) -> None:
        trace.add(work, to(name, phase), fusable=fusable, backward=phase == "backward",
                  inputs=inputs, outputs=outputs)

    trace = _Trace()
    params: dict[int, tuple[tuple[str, ...], torch.Tensor]] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        key = p.untyped_storage()._cdata
        params[key] = ((*params[key][0], name) if key in params else (name,), p)
    recorder = _Recorder(trace, charge_to, gemm_to, params)
    interp = _WorkInterpreter(gm, recorder, record_kernel)
    with torch.enable_grad(), recorder:
        loss = interp.run(*inputs)
        recorder.phase = None
        loss.backward()
    trace.finish()
    return works


def function_work(fn: Callable[[], object]) -> tuple[Work, Work]:
    """(forward, backward) work of `fn()`, which runs some ops and then their backward; every
    op before the first backward op counts as forward (the calibration probes)."""
    forward, backward = Work(), Work()

    def charge_to(phase: str | None) -> Callable[[Work], None]:
        running_backward = torch._C._current_autograd_node() is not None
        return (backward if running_backward else forward).add

    trace = _Trace()
    with _Recorder(trace, charge_to):
        fn()
    trace.finish()
    return forward, backward
