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
- *attention kernel*: `scaled_dot_product_attention` without dropout runs as
  a fused flash kernel: forward 4·b·a·s_q·s_kv·d FLOPs (`flops.sdpa_flops`),
  backward 2.5 times that — flash attention's backward runs five of the
  forward's two matrix products per tile, recomputing the scores (Dao 2023,
  FlashAttention-2, section 3.1.2) — and it reads and writes q, k, v, the
  output and its log-sum-exp once each way (`Work.attention`, bytes in
  `Work.memory`). With dropout it runs written out ("math"): its matrix
  products are GEMMs and its scale, mask, softmax and dropout are element-wise
  ops over the s × s scores;
- *memory-bound op*: any other op that is not a view: it moves the bytes of
  its tensor inputs and outputs (`Work.memory`), except that a lookup
  (embedding, index_select, gather, nll_loss) reads only the rows it gathers;
- *view*: an op whose output aliases its input (view, transpose, expand,
  split, detach, ...): no device work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ptc.compiler.flops import sdpa_flops

FLASH_BACKWARD = 2.5
"""FLOPs of flash attention's backward over its forward's: five matrix products per tile
(the scores recomputed, dV, dP, dQ, dK) against the forward's two (Dao 2023,
FlashAttention-2, section 3.1.2)."""

_GEMMS = {"mm": 0, "addmm": 1, "bmm": 0, "baddbmm": 1}
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

    def add(self, other: Work, scale: float = 1.0) -> None:
        """Add `other` (times `scale`) into this."""
        self.gemm += scale * other.gemm
        self.attention += scale * other.attention
        self.memory += scale * other.memory
        self.ops += scale * other.ops


@dataclass(slots=True)
class NodeWork:
    """Forward and backward work charged to one graph node."""

    forward: Work = field(default_factory=Work)
    backward: Work = field(default_factory=Work)


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
        left = args[_GEMMS[name]]
        out_t = out if isinstance(out, torch.Tensor) else tree_leaves(out)[0]
        return Work(gemm=2.0 * out_t.numel() * left.shape[-1], ops=1)
    tensors_in = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    tensors_out = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if name in _LOOKUPS:
        gathered = sum(_nbytes(t) for t in tensors_out)
        indices = sum(_nbytes(t) for t in tensors_in if not t.is_floating_point())
        return Work(memory=2.0 * gathered + indices, ops=1)
    return Work(memory=float(sum(_nbytes(t) for t in (*tensors_in, *tensors_out))), ops=1)


class _Recorder(TorchDispatchMode):
    """Charges every aten call to `charge(work, phase)`."""

    def __init__(self, charge: Callable[[Work, str | None], None]):
        super().__init__()
        self.charge = charge
        self.phase: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.charge(op_work(func, args, kwargs, out), self.phase)
        return out


class _FlashAttention(torch.autograd.Function):
    """Meta stand-in for a flash attention kernel: its output, and its work each way."""

    @staticmethod
    def forward(ctx, q, k, v, charge):  # noqa: D102 - autograd.Function protocol
        flops = sdpa_flops(q.shape, k.shape, v.shape)
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = 4 * q.shape[:-1].numel()
        moved = _nbytes(q) + _nbytes(k) + _nbytes(v) + _nbytes(out)
        charge(Work(attention=flops, memory=moved + lse, ops=1), "forward")
        ctx.shapes = (q, k, v)
        ctx.work = Work(attention=FLASH_BACKWARD * flops, memory=2 * moved + lse, ops=1)
        ctx.charge = charge
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102 - autograd.Function protocol
        ctx.charge(ctx.work, "backward")
        q, k, v = ctx.shapes
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


class _WorkInterpreter(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, recorder: _Recorder, charge_flash):
        super().__init__(gm, garbage_collect_values=False)
        self.recorder, self.charge_flash = recorder, charge_flash
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

    def call_function(self, target, args, kwargs):
        if target in _SDPA and _flash(args, kwargs):
            name = self.current
            return _FlashAttention.apply(
                *args[:3], lambda w, phase: self.charge_flash(name, w, phase))
        return super().call_function(target, args, kwargs)


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

    def charge(work: Work, phase: str | None) -> None:
        name = (interp.current or output) if phase == "forward" else node_of_backward()
        if name is None:
            return
        entry = works.setdefault(name, NodeWork())
        (entry.forward if phase == "forward" else entry.backward).add(work)

    def charge_flash(name: str, work: Work, phase: str) -> None:
        entry = works.setdefault(name, NodeWork())
        (entry.forward if phase == "forward" else entry.backward).add(work)

    recorder = _Recorder(charge)
    interp = _WorkInterpreter(gm, recorder, charge_flash)
    with torch.enable_grad(), recorder:
        loss = interp.run(*inputs)
        recorder.phase = None
        loss.backward()
    return works


def function_work(fn: Callable[[], object]) -> tuple[Work, Work]:
    """(forward, backward) work of `fn()`, which runs some ops and then their backward; every
    op before the first backward op counts as forward (the calibration probes)."""
    forward, backward = Work(), Work()

    def charge(work: Work, phase: str | None) -> None:
        running_backward = torch._C._current_autograd_node() is not None
        (backward if running_backward else forward).add(work)

    with _Recorder(charge):
        fn()
    return forward, backward
