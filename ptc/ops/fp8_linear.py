"""Linear layers whose GEMMs take float8 operands (`train.dtype = fp8`).

Transformer Engine's hybrid recipe: weights, master weights, optimizer and
every other op stay in bf16/fp32; only the three GEMMs of a linear read
float8 operands, each tensor with one scale:

    forward   y  = x Wᵀ      x, W in e4m3 (3 mantissa bits, largest 448)
    dgrad     dx = dy W      dy in e5m2 (2 mantissa bits, largest 57344)
    wgrad     dW = dyᵀ x

Terms: a tensor's *scale* s is what its float8 values are multiplied by to
give it back: s = amax / fmax, where amax is its largest magnitude and fmax
the format's largest finite value; quantising is q = (x / s) rounded to the
format (`.to(float8)`, round to nearest even), clamped to ±fmax first, since
e4m3fn has no infinity and a value over fmax would become NaN. The products
accumulate in fp32 and come out in the input's dtype.

Scaling (`train.fp8_scaling`):
- current: amax is the tensor's own, now;
- delayed: amax is the largest of the last `fp8_amax_history` optimizer
  steps' amaxes of that tensor, so a value larger than any of them saturates
  at fmax. Each call records its amax into the step's slot (a running max,
  so several micro-batches and a recomputed forward record the same) and
  `advance_amax_history` closes the step. A step with an empty history (the
  first one) scales as current.
Under tensor parallelism every amax is reduced (max) over the tp group, so
the ranks quantise with the scale of the whole tensor, exactly as an
unsplit run would (Transformer Engine's amax reduction group); over dp the
scales of activations and gradients stay each rank's own. The history is
the op's state, not a parameter or buffer; checkpoints keep it beside the
weights (`ptc.runtime.fp8_state`), so a resumed run scales as an
uninterrupted one.

The weight is saved for backward as it is (as `F.linear` saves it, so
ZeRO-3's hooks see it) and quantised again there with the forward's scale,
to the same bytes; Transformer Engine keeps a float8 copy instead. The input
is saved as its float8 copy: one byte an element. Under sequence parallelism
an input all-gathered along the sequence (`ptc.ops.seq_regather`) is kept as
the float8 copy of the rank's chunk, gathered again in backward, as
Transformer Engine keeps it: quantising is element by element, so the
gathered chunks are the copy of the whole.

Where: `torch._scaled_mm` on CUDA devices of compute capability 8.9 or
more (the shapes it takes: dimensions multiples of 16; others multiply the
dequantised operands); emulated (`train.fp8_emulate`), every GEMM
multiplies the dequantised operands in fp32: the same float8 values and
scales, so the scaling is checked on any device. Either way a GEMM is one
op, `torch.ops.ptc.fp8_gemm` (the forward's with the bias added), so a
saving checkpoint region keeps the linear's bf16 output and nothing else.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ptc.ops.comm import all_reduce_flat, axis_group
from ptc.ops.seq_regather import current_session

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
INPUT, WEIGHT, GRAD = 0, 1, 2
"""Rows of a linear's scaling state: its input, its weight, its output gradient."""
FORMATS = (E4M3, E4M3, E5M2)
"""The float8 format of each row."""
MIN_CAPABILITY = (8, 9)
"""CUDA compute capability from which `torch._scaled_mm` multiplies float8 (Ada, Hopper)."""


def device_has_fp8(device: torch.device | str) -> bool:
    """Whether GEMMs on `device` can take float8 operands (CUDA, capability 8.9 or more)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and \
        torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """`x / scale` in `fmt`, round to nearest, clamped to the format's largest value."""
    top = torch.finfo(fmt).max
    return (x.float() / scale).clamp(-top, top).to(fmt)


def scale_of(amax: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """The scale amax / fmax of a tensor whose largest magnitude is `amax` (1 for amax 0)."""
    return torch.where(amax > 0, amax / torch.finfo(fmt).max, torch.ones_like(amax))


class Fp8Scaling(nn.Module):
    """The scaling state of one float8 linear: how its three tensors are scaled, and for
    delayed scaling their amax history (see the module docstring).

    The graph reads it with a get_attr node and passes it to `fp8_linear`. It holds no
    parameters or buffers: `history` ([3, window] fp32, newest first) and `pending` (the
    running step's amaxes) are made on the device of the first tensor it scales.
    """

    def __init__(self, *, delayed: bool, window: int, emulate: bool, axis: str | None):
        """`delayed`: delayed (else current) scaling over `window` steps; `emulate`: multiply
        dequantised operands in fp32; `axis`: the mesh axis amaxes are reduced over."""
        super().__init__()
        self.delayed, self.window, self.emulate, self.axis = delayed, window, emulate, axis
        self.history: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None

    def extra_repr(self) -> str:  # noqa: D102 - nn.Module protocol
        how = f"delayed over {self.window} steps" if self.delayed else "current"
        return f"{how}{', emulated' if self.emulate else ''}, amax over {self.axis}"

    def scale(self, which: int, x: torch.Tensor) -> torch.Tensor:
        """The scale of tensor `which` (INPUT, WEIGHT, GRAD) of value `x`; records its amax."""
        fmt = FORMATS[which]
        amax = x.detach().abs().amax().float().reshape(1)
        group = axis_group(self.axis) if self.axis else None
        all_reduce_flat(amax, group, dist.ReduceOp.MAX).wait()
        if x.is_meta:  # the verifier's shape run: no state
            return scale_of(amax, fmt)
        if self.history is None or self.history.device != amax.device:
            self.history = torch.zeros(3, self.window, device=amax.device)
            self.pending = torch.zeros(3, device=amax.device)
        finite = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
        self.pending[which] = torch.maximum(self.pending[which], finite[0])
        if self.delayed:
            past = self.history[which].amax().reshape(1)
            amax = torch.where(past > 0, past, amax)
        return scale_of(amax, fmt)

    def saved_history(self, device: torch.device) -> torch.Tensor:
        """The history a checkpoint keeps: [3, window], newest first (zeros before the first
        step: an empty history, as `scale` reads it). Between steps nothing is pending."""
        if self.history is None:
            return torch.zeros(3, self.window, device=device)
        return self.history

    def load_history(self, history: torch.Tensor, device: torch.device) -> None:
        """Continue from a checkpointed `history` ([3, any window], newest first): its newest
        entries fill this window, zeros (empty) the rest."""
        window = torch.zeros(3, self.window, device=device)
        kept = min(self.window, history.shape[1])
        window[:, :kept] = history[:, :kept].to(device)
        self.history, self.pending = window, torch.zeros(3, device=device)

    def advance(self) -> None:
        """Close an optimizer step: its amaxes become the newest of the history."""
        if self.history is not None:
            self.history = torch.cat([self.pending.unsqueeze(1), self.history[:, :-1]], dim=1)
            self.pending = torch.zeros_like(self.pending)


def advance_amax_history(module: nn.Module) -> int:
    """Close the optimizer step for every `Fp8Scaling` in `module`; returns how many."""
    states = [m for m in module.modules() if isinstance(m, Fp8Scaling)]
    for state in states:
        state.advance()
    return len(states)


@torch.library.custom_op("ptc::fp8_gemm", mutates_args=())
def fp8_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    """(a·sa) @ (b·sb) of float8 `a` [M, K] and `b` [K, N], accumulated in fp32, as
    `out_dtype`, plus `bias` (None: none): `torch._scaled_mm` on a float8 device, else of
    the dequantised operands.

    One op to the dispatcher, as a linear's GEMM is one kernel: a saving checkpoint region
    (`ptc.ops.recompute.SAVED_OPS`) keeps its output, the linear's own (bias added), in
    `out_dtype`, as it keeps a bf16 linear's, whether the product ran on float8 hardware or
    was emulated."""
    out = _product(a, sa, b, sb, out_dtype, emulate)
    return out if bias is None else out + bias


def _product(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
             out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    scaled = not emulate and not a.is_meta and all(n % 16 == 0 for n in (*a.shape, b.shape[1]))
    if not emulate and not a.is_meta and not device_has_fp8(a.device):
        raise RuntimeError(f"train.dtype = fp8: {a.device} has no float8 matmuls (CUDA compute "
                           "capability 8.9+); set train.fp8_emulate = true to emulate")
    if scaled:
        # cuBLAS takes a row-major first and a column-major second operand.
        return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=sa.reshape(()),
                                scale_b=sb.reshape(()), out_dtype=out_dtype)
    return ((a.float() * sa) @ (b.float() * sb)).to(out_dtype)


@fp8_gemm.register_fake
def _fp8_gemm_shape(a, sa, b, sb, bias, out_dtype, emulate):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, scaling):  # noqa: D102 - autograd.Function protocol
        sx, sw = scaling.scale(INPUT, x), scaling.scale(WEIGHT, weight)
        xq = quantize(x, sx, E4M3).reshape(-1, x.shape[-1])
        wq = quantize(weight, sw, E4M3)
        out = fp8_gemm(xq, sx, wq.t(), sw, bias, x.dtype, scaling.emulate)
        out = out.reshape(*x.shape[:-1], weight.shape[0])
        session = current_session()
        gathered = session.gathered(x) if session is not None else None
        ctx.gather = None
        if gathered is not None:  # keep the rank's chunk of the copy; gather it in backward
            chunk, ctx.gather = gathered
            xq = quantize(chunk, sx, E4M3)
        ctx.save_for_backward(xq, sx, weight, sw)
        ctx.scaling, ctx.x_shape, ctx.x_dtype = scaling, x.shape, x.dtype
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        xq, sx, weight, sw = ctx.saved_tensors
        if ctx.gather is not None:  # float8 bytes travel as bytes
            xq = ctx.gather(xq.view(torch.uint8)).view(E4M3)
        xq = xq.reshape(-1, ctx.x_shape[-1])
        scaling = ctx.scaling
        sg = scaling.scale(GRAD, dy)
        gq = quantize(dy, sg, E5M2).reshape(-1, dy.shape[-1])
        wq = quantize(weight, sw, E4M3)  # the forward's bytes: same weight, same scale
        dx = fp8_gemm(gq, sg, wq, sw, None, ctx.x_dtype, scaling.emulate).reshape(ctx.x_shape)
        dw = fp8_gemm(gq.t(), sg, xq, sx, None, weight.dtype, scaling.emulate)
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias else None
        return dx, dw, db, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               scaling: Fp8Scaling) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with float8 GEMMs scaled by `scaling` (module docstring).

    Forward: y = x Wᵀ + b of x and W quantised to e4m3. Backward: the output
    gradient quantised to e5m2; dx = dy W and dW = dyᵀ x of the float8
    operands (W quantised again with its forward scale, x its saved float8
    copy); db = the sum of dy, in the compute dtype. Under tp each amax is a
    max over the tp group (one scalar all-reduce per tensor).
    """
    return _Fp8Linear.apply(x, weight, bias, scaling)
