"""Linear layers whose GEMMs take float8 operands (`train.dtype = fp8`).

Transformer Engine's hybrid recipe: weights, master weights, optimizer and
every other op stay in bf16/fp32; only the three GEMMs of a linear (and of
a routed experts' grouped product, expert by expert: `ptc.ops.fp8_grouped`)
read float8 operands, each tensor with one scale:

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

Recipes (`train.fp8_recipe`): the above is "tensorwise", one scale per
tensor. The two others scale along each GEMM's contraction dimension, so
every operand is quantised once per GEMM it feeds (x, W and dy twice each),
all in e4m3 (fmax 448), with current scaling only:

    GEMM               contracts   a's scales              b's scales
    forward  y = x Wᵀ  K           x: one per row          W: one per output row
    dgrad   dx = dy W  N           dy: one per row         W: one per column
    wgrad   dW = dyᵀ x M (tokens)  dy: one per column      x: one per column

- rowwise (torchao's float8 "rowwise"): one fp32 scale amax / 448 per row
  or column of the operand. `torch._scaled_mm` with scale_a [M, 1] and
  scale_b [1, N] (bf16 output) on CUDA capability 9.0 or more.
- mxfp8 (OCP Microscaling v1.0): each block of 32 consecutive elements along
  the contraction dimension shares one power-of-two scale, an E8M0 byte:
  X = 2^(floor(log2(amax)) - 8), 8 = floor(log2(448)) being e4m3's largest
  normal exponent (the spec's shared-exponent rule, torchao's FLOOR mode;
  clamped to E8M0's 2^-127..2^127); elements beyond 448 after the division
  (up to 512) saturate at ±448. Every contraction dimension must be a whole
  number of blocks on each rank (refused at compile, no padding). Real MX
  GEMMs need capability 10.0; ptc has not verified `torch._scaled_mm`'s
  block-scale layout, so mxfp8 runs emulated only (refused otherwise).

What backward keeps: x's column-quantised copy for the weight gradient
(rowwise: its K fp32 column scales; mxfp8: one E8M0 byte per 32 elements)
and the weight as it is, quantised again by columns in backward. Under
tensor parallelism a scale whose row or column is split over tp takes the
max over the tp group of the ranks' amaxes (one all-reduce of the vector):
x's and W's rows in a row-parallel linear's forward, dy's rows and W's
columns in a column-parallel linear's dgrad (`Fp8Scaling.role`); the others
are whole on every rank. Under sequence parallelism the forward reads the
gathered x, so x's column scales already span the whole sequence; the copy
kept is the rank's chunk quantised with them (mxfp8: the chunk's own blocks,
which are the whole sequence's when a chunk holds whole blocks), gathered
again in backward with its scales. mxfp8's blocks never straddle ranks, so
it reduces nothing.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ptc.ops.comm import all_reduce_flat, axis_group, group_rank
from ptc.ops.seq_regather import current_session

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
INPUT, WEIGHT, GRAD = 0, 1, 2
"""The tensors a scaling state scales: a GEMM's input, its weight, its output gradient."""
FORMATS = (E4M3, E4M3, E5M2)
"""The float8 format of each."""
MIN_CAPABILITY = (8, 9)
"""CUDA compute capability from which `torch._scaled_mm` multiplies float8 (Ada, Hopper)."""
RECIPES = ("tensorwise", "rowwise", "mxfp8")
"""`train.fp8_recipe`: one scale per tensor, per row/column, per block of 32 (docstring)."""
RECIPE_CAPABILITY = {"tensorwise": MIN_CAPABILITY, "rowwise": (9, 0)}
"""Capability from which each recipe's GEMMs run on float8 hardware; mxfp8 has none here: its
block-scaled `torch._scaled_mm` (capability 10.0) is unverified, so it runs emulated only."""
MX_BLOCK = 32
"""Elements along the contraction dimension that share one mxfp8 scale."""
E4M3_EMAX = 8
"""floor(log2(448)): the exponent of e4m3's largest normal value (OCP MX's emax_elem)."""
E8M0 = torch.float8_e8m0fnu
COLUMN, ROW = "column", "row"
"""`Fp8Scaling.role`: a column-parallel linear (output features split over tp) or a
row-parallel one (input features split)."""


def device_has_fp8(device: torch.device | str, recipe: str = "tensorwise") -> bool:
    """Whether GEMMs on `device` can take float8 operands scaled as `recipe` does (CUDA,
    capability 8.9 or more for tensorwise, 9.0 for rowwise; never for mxfp8, docstring)."""
    device = torch.device(device)
    need = RECIPE_CAPABILITY.get(recipe)
    return need is not None and device.type == "cuda" and torch.cuda.is_available() and \
        torch.cuda.get_device_capability(device) >= need


def no_fp8_reason(device: torch.device | str, recipe: str) -> str:
    """The one line refusing `recipe`'s float8 GEMMs on `device` without emulation."""
    if recipe == "mxfp8":
        return ("train.fp8_recipe = mxfp8 runs emulated only (MX GEMMs need CUDA compute "
                "capability 10.0 and ptc has not verified torch._scaled_mm's block-scale "
                "layout); set train.fp8_emulate = true to emulate")
    what = "float8" if recipe == "tensorwise" else f"{recipe}-scaled float8"
    major, minor = RECIPE_CAPABILITY[recipe]
    return (f"train.dtype = fp8: {device} has no {what} matmuls (CUDA compute capability "
            f"{major}.{minor}+); set train.fp8_emulate = true to emulate")


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """`x / scale` in `fmt`, round to nearest, clamped to the format's largest value."""
    top = torch.finfo(fmt).max
    return (x.float() / scale).clamp(-top, top).to(fmt)


def scale_of(amax: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """The scale amax / fmax of a tensor whose largest magnitude is `amax` (1 for amax 0)."""
    return torch.where(amax > 0, amax / torch.finfo(fmt).max, torch.ones_like(amax))


def mx_scale(amax: torch.Tensor) -> torch.Tensor:
    """OCP MX's shared scale of blocks whose largest magnitudes are `amax`, as E8M0 bytes:
    2^(floor(log2(amax)) - 8), clamped to 2^-127..2^127 (module docstring); an all-zero
    block (log2 0 = -inf) takes the smallest."""
    amax = amax.float()
    _, exponent = torch.frexp(amax)  # amax = m·2^e, m in [0.5, 1): floor(log2) = e - 1
    power = torch.where(amax > 0, exponent - 1 - E4M3_EMAX, -127).clamp(-127, 127)
    return torch.ldexp(torch.ones_like(amax, dtype=torch.float32), power).to(E8M0)


def expand_scale(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """`scale` spread over an operand of `shape`: block scales repeated along their blocks
    (rowwise and tensorwise scales broadcast as they are)."""
    if scale.dim() != len(shape):
        return scale
    scale = scale.float()
    for dim, (n, size) in enumerate(zip(scale.shape, shape)):
        if n not in (1, size):
            scale = scale.repeat_interleave(size // n, dim=dim)
    return scale


def quantize_along(t: torch.Tensor, dim: int, recipe: str, group=None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, scales) of `t` (a matrix, or a stack of experts' matrices) scaled along
    `dim`, the dimension its GEMM contracts: rowwise one fp32 scale per line along `dim`
    (its amax reduced (max) over `group` when that dimension is split over it), mxfp8 one
    E8M0 scale per block of 32."""
    magnitude = t.detach().abs()
    if recipe == "rowwise":
        amax = magnitude.amax(dim, keepdim=True).float()
        if group is not None:
            all_reduce_flat(amax, group, dist.ReduceOp.MAX).wait()
        scale = scale_of(amax, E4M3)
    else:
        scale = mx_scale(_block_amax(magnitude, dim))
    return quantize(t, expand_scale(scale, t.shape), E4M3), scale


def _block_amax(magnitude: torch.Tensor, dim: int) -> torch.Tensor:
    """Largest of each block of MX_BLOCK consecutive elements along `dim` of `magnitude`."""
    if magnitude.shape[dim] % MX_BLOCK:
        raise ValueError(f"train.fp8_recipe = mxfp8: a contraction dimension of "
                         f"{magnitude.shape[dim]} is no multiple of {MX_BLOCK}")
    lines = magnitude.movedim(dim, -1)
    blocks = lines.reshape(*lines.shape[:-1], -1, MX_BLOCK).amax(-1)
    return blocks.movedim(-1, dim)


class Fp8Scaling(nn.Module):
    """The scaling state of one float8 linear or grouped product: how its tensors are scaled,
    and for delayed scaling their amax history (see the module docstring).

    The graph reads it with a get_attr node and passes it to `fp8_linear` (or
    `ptc.ops.fp8_grouped.fp8_grouped_mm`). It holds no parameters or buffers: `history`
    ([experts + 2, window] fp32, newest first: the input's row, one row per weight, the
    output gradient's row; a linear's is [3, window]) and `pending` (the running step's
    amaxes) are made on the device of the first tensor it scales.
    """

    def __init__(self, *, delayed: bool, window: int, emulate: bool, axis: str | None,
                 recipe: str = "tensorwise", role: str | None = None, experts: int = 1,
                 expert_axis: str | None = None):
        """`delayed`: delayed (else current) scaling over `window` steps; `emulate`: multiply
        dequantised operands in fp32; `axis`: the mesh axis amaxes are reduced over;
        `recipe`: one of RECIPES; `role`: COLUMN, ROW or None (not split over tp), which
        says the scale vectors rowwise reduces over `axis` (module docstring). `experts`:
        the weights it scales, one history row each: 1 for a linear, every routed expert
        of a stack for a grouped product, whichever of them a rank holds; `expert_axis`:
        the mesh axis whose rank j holds the j-th slice of those experts."""
        super().__init__()
        self.delayed, self.window, self.emulate, self.axis = delayed, window, emulate, axis
        self.recipe, self.role = recipe, role
        self.experts, self.expert_axis = experts, expert_axis
        self.history: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None

    def extra_repr(self) -> str:  # noqa: D102 - nn.Module protocol
        how = f"delayed over {self.window} steps" if self.delayed else "current"
        kind = "" if self.recipe == "tensorwise" else f"{self.recipe} ({self.role or 'whole'}), "
        experts = f", {self.experts} experts" if self.experts > 1 else ""
        return f"{kind}{how}{', emulated' if self.emulate else ''}, amax over {self.axis}{experts}"

    def split_group(self, role: str):
        """The tp group a scale vector contracted over a dimension split in a `role` linear
        reduces over: rowwise only, in that role; else None (local)."""
        if self.recipe != "rowwise" or self.role != role or not self.axis:
            return None
        return axis_group(self.axis)

    def scale(self, which: int, x: torch.Tensor) -> torch.Tensor:
        """The scale of tensor `which` (INPUT, WEIGHT, GRAD) of value `x`; records its amax."""
        row = {INPUT: 0, WEIGHT: 1, GRAD: self.experts + 1}[which]
        return self._scales(row, x.detach().abs().amax().float().reshape(1), FORMATS[which])

    def expert_scales(self, weight: torch.Tensor) -> torch.Tensor:
        """The scale of each expert's weight in `weight` [experts held, ., .], one each; records
        their amaxes in the rows of the experts the rank holds."""
        first = group_rank(axis_group(self.expert_axis)) * weight.shape[0] \
            if self.expert_axis else 0
        amax = weight.detach().abs().amax(dim=(1, 2)).float()
        return self._scales(1 + first, amax, FORMATS[WEIGHT])

    def _scales(self, row: int, amax: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
        """Scales of the tensors whose amaxes are `amax` and history rows start at `row`:
        each amax reduced (max) over tp, recorded, and under delayed scaling replaced by
        its history's where that holds one."""
        group = axis_group(self.axis) if self.axis else None
        all_reduce_flat(amax, group, dist.ReduceOp.MAX).wait()
        if amax.is_meta:  # the verifier's shape run: no state
            return scale_of(amax, fmt)
        if self.history is None or self.history.device != amax.device:
            self.history = torch.zeros(self.experts + 2, self.window, device=amax.device)
            self.pending = torch.zeros(self.experts + 2, device=amax.device)
        rows = slice(row, row + amax.numel())
        finite = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
        self.pending[rows] = torch.maximum(self.pending[rows], finite)
        if self.delayed:
            past = self.history[rows].amax(1)
            amax = torch.where(past > 0, past, amax)
        return scale_of(amax, fmt)

    def saved_history(self, device: torch.device) -> torch.Tensor:
        """The history a checkpoint keeps: [experts + 2, window], newest first (zeros before
        the first step: an empty history, as `scale` reads it). Between steps nothing is
        pending."""
        if self.history is None:
            return torch.zeros(self.experts + 2, self.window, device=device)
        return self.history

    def load_history(self, history: torch.Tensor, device: torch.device) -> None:
        """Continue from a checkpointed `history` ([experts + 2, any window], newest first):
        its newest entries fill this window, zeros (empty) the rest."""
        window = torch.zeros(self.experts + 2, self.window, device=device)
        kept = min(self.window, history.shape[1])
        window[:, :kept] = history[:, :kept].to(device)
        self.history, self.pending = window, torch.zeros(self.experts + 2, device=device)

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
    recipe = _recipe_of(sa, sb)
    if not emulate and not a.is_meta and not device_has_fp8(a.device, recipe):
        raise RuntimeError(no_fp8_reason(a.device, recipe))
    scaled = not emulate and not a.is_meta and all(n % 16 == 0 for n in (*a.shape, b.shape[1]))
    # cuBLAS takes a row-major first and a column-major second operand.
    if scaled and recipe == "tensorwise":
        return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=sa.reshape(()),
                                scale_b=sb.reshape(()), out_dtype=out_dtype)
    if scaled and out_dtype == torch.bfloat16:  # rowwise: scales [M, 1] and [1, N], bf16 out
        return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(),
                                scale_a=sa.reshape(-1, 1).contiguous(),
                                scale_b=sb.reshape(1, -1).contiguous(), out_dtype=out_dtype)
    return ((a.float() * expand_scale(sa, a.shape)) @ (b.float() * expand_scale(sb, b.shape))
            ).to(out_dtype)


def _recipe_of(sa: torch.Tensor, sb: torch.Tensor) -> str:
    """The recipe whose scales `sa`, `sb` are: E8M0 blocks, one each ([1]), or vectors."""
    if sa.dtype == E8M0:
        return "mxfp8"
    return "tensorwise" if sa.dim() == 1 and sb.dim() == 1 else "rowwise"


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


class _ContractionScaledLinear(torch.autograd.Function):
    """A linear whose GEMMs scale each operand along their contraction dimension (rowwise,
    mxfp8; module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, scaling):  # noqa: D102 - autograd.Function protocol
        recipe, split = scaling.recipe, scaling.split_group(ROW)
        x2 = x.reshape(-1, x.shape[-1])
        xq, sx = quantize_along(x2, 1, recipe, split)
        wq, sw = quantize_along(weight, 1, recipe, split)
        out = fp8_gemm(xq, sx, wq.t(), sw.t(), bias, x.dtype, scaling.emulate)
        session = current_session()
        gathered = session.gathered(x) if session is not None else None
        ctx.gather = None
        if gathered is None:
            xc, sxc = quantize_along(x2, 0, recipe)
        else:  # keep the rank's chunk of the column copy; gather it in backward
            chunk, ctx.gather = gathered
            xc, sxc = _chunk_copy(x, chunk, recipe)
        ctx.save_for_backward(xc, sxc, weight)
        ctx.scaling, ctx.x_shape, ctx.x_dtype = scaling, x.shape, x.dtype
        ctx.has_bias = bias is not None
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        xc, sxc, weight = ctx.saved_tensors
        if ctx.gather is not None:  # float8 and E8M0 bytes travel as bytes
            xc = ctx.gather(xc.view(torch.uint8)).view(E4M3)
            if sxc.dtype == E8M0:
                sxc = ctx.gather(sxc.view(torch.uint8)).view(E8M0)
        k = ctx.x_shape[-1]
        xc, sxc = xc.reshape(-1, k), sxc.reshape(-1, k)
        scaling = ctx.scaling
        recipe, split = scaling.recipe, scaling.split_group(COLUMN)
        dy2 = dy.reshape(-1, dy.shape[-1])
        gq, sg = quantize_along(dy2, 1, recipe, split)
        wq, sw = quantize_along(weight, 0, recipe, split)
        dx = fp8_gemm(gq, sg, wq, sw, None, ctx.x_dtype, scaling.emulate).reshape(ctx.x_shape)
        gc, sgc = quantize_along(dy2, 0, recipe)
        dw = fp8_gemm(gc.t(), sgc.t(), xc, sxc, None, weight.dtype, scaling.emulate)
        db = dy2.sum(0) if ctx.has_bias else None
        return dx, dw, db, None


def _chunk_copy(x: torch.Tensor, chunk: torch.Tensor, recipe: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(column copy, its scales) a linear keeps of the rank's `chunk` of its gathered input
    `x`, each laid out as `chunk` is along the sequence, so that the session's gather joins
    them into the whole sequence's.

    rowwise: the chunk quantised with the column scales of the whole gathered x (kept
    whole). mxfp8: the chunk's own blocks, which are the gathered x's when every run of
    tokens from the sequence dimension on holds whole blocks (checked)."""
    seq_dim = next(d for d in range(chunk.dim()) if chunk.shape[d] != x.shape[d])
    flat = chunk.reshape(-1, chunk.shape[-1])
    if recipe == "rowwise":
        _, scale = quantize_along(x.reshape(-1, x.shape[-1]), 0, recipe)
        return quantize(flat, scale, E4M3).reshape(chunk.shape), scale
    run = math.prod(chunk.shape[seq_dim:-1])
    if run % MX_BLOCK:
        raise ValueError(f"train.fp8_recipe = mxfp8 under sequence parallelism: a rank's "
                         f"chunk holds runs of {run} tokens, no multiple of {MX_BLOCK}")
    xc, scale = quantize_along(flat, 0, recipe)
    shape = (*chunk.shape[:seq_dim], run // MX_BLOCK, *[1] * (chunk.dim() - seq_dim - 2),
             chunk.shape[-1])
    return xc.reshape(chunk.shape), scale.reshape(shape)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               scaling: Fp8Scaling) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with float8 GEMMs scaled by `scaling` (module docstring).

    Forward: y = x Wᵀ + b of x and W quantised to e4m3. Backward: the output
    gradient quantised to e5m2; dx = dy W and dW = dyᵀ x of the float8
    operands (W quantised again with its forward scale, x its saved float8
    copy); db = the sum of dy, in the compute dtype. Under tp each amax is a
    max over the tp group (one scalar all-reduce per tensor). The rowwise and
    mxfp8 recipes quantise each operand along each GEMM's contraction
    dimension instead, all in e4m3 (module docstring).
    """
    if scaling.recipe == "tensorwise":
        return _Fp8Linear.apply(x, weight, bias, scaling)
    return _ContractionScaledLinear.apply(x, weight, bias, scaling)
