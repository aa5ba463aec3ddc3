"""Routed experts' grouped products whose GEMMs take float8 operands (`train.dtype = fp8`).

A grouped product `torch._grouped_mm(x, W, offs)` multiplies the rows of
x [M, K] in group e — rows offs[e-1] .. offs[e], the rows routed to expert e —
by that expert's weight W[e] [K, N] (`ptc.compiler.graph.moe_structure`).
Megatron-Core with Transformer Engine runs these GEMMs in float8 as it runs
a linear's (TEGroupedLinear); so does ptc, with the terms, formats and
scaling of `ptc.ops.fp8_linear`, per expert where a linear has one weight:

    forward  y_e  = x_e W[e]        contracts K
    dgrad    dx_e = dy_e W[e]ᵀ      contracts N
    wgrad    dW[e] = x_eᵀ dy_e      contracts the group's rows

Scales (`train.fp8_recipe`):
- tensorwise: one scale for x (e4m3), one for dy (e5m2), one per expert's
  weight (e4m3); under delayed scaling each has its history row in the
  product's `Fp8Scaling` (a row per expert of the whole stack, so that an
  ep rank records its experts' rows and a checkpoint holds one history
  whatever ep holds which experts).
- rowwise (e4m3, current scaling): x and dy one scale per row (along K, N),
  W[e] one per output column along K (forward) and one per row along N
  (dgrad); the weight gradient contracts each group's rows, so x and dy are
  scaled once more by column within each group (torchao's float8 MoE
  training recipe).
- mxfp8: the same contractions in blocks of 32 elements with E8M0 scales;
  K and N must hold whole blocks on each rank (the quantize_gemms pass
  refuses otherwise), a group's rows need not: its last block holds what
  is left, as the zero-padding of each expert's rows to whole blocks that
  Megatron-Core applies would give it (padding adds nothing to a block's
  amax or to the product).

Under tensor parallelism an expert stack is split as a linear is
(`Fp8Scaling.role`: gate/up column-parallel, down row-parallel), and its
amaxes are reduced as a linear's: every tensorwise amax (the per-expert
ones as a vector) over tp, and rowwise's scale vectors along a split
contraction dimension. Under expert parallelism the op multiplies the rows
an ep rank received by its local experts with their local offsets
(`ptc.passes.quantize_gemms` runs after `shard_experts`): x's and dy's
scales are those of the rows it holds, as Transformer Engine's are.

Backward keeps x's float8 copy (tensorwise; rowwise and mxfp8 its
group-column copy) with its scales, the weight as it is (quantised again
with its scales in backward, so ZeRO-3's hooks see the parameter) and the
offsets; tensorwise also the experts' weight scales.

Where: the forward's and the input gradient's products are one op,
`torch.ops.ptc.fp8_grouped_gemm` (so a saving checkpoint region keeps the
grouped product's output and nothing else): `torch._scaled_grouped_mm` on
CUDA devices of compute capability 9.0 or more where both operands are e4m3
with fp32 scales (the forward; rowwise's dgrad) and K and N are multiples of
16; else, and under `train.fp8_emulate`, the dequantised operands multiplied
in fp32 group by group: the same float8 values and scales. The weight
gradient always multiplies so: torch's scaled kernel for it wants each
group's rows in multiples of 16, which routing does not give (torchao pads
the groups to get them). mxfp8 runs emulated only, as a linear's.
"""

from __future__ import annotations

import torch

from ptc.ops.expert_parallel import expert_counts
from ptc.ops.fp8_linear import (COLUMN, E4M3, E5M2, GRAD, INPUT, MX_BLOCK, ROW, Fp8Scaling,
                                device_has_fp8, expand_scale, mx_scale, no_fp8_reason,
                                quantize, quantize_along, scale_of)


def fp8_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                   scaling: Fp8Scaling) -> torch.Tensor:
    """`torch._grouped_mm(x, weight, offs)` with float8 GEMMs scaled by `scaling`.

    x [M, K] holds the routed rows grouped by expert, `weight` [E, K, N] the
    (rank's) experts' weights, `offs` [E] each group's end row. Forward: each
    group's rows times its expert's weight, both quantised to e4m3. Backward:
    dy quantised (tensorwise e5m2, else e4m3); dx = dy W[e]ᵀ of the float8
    operands (W quantised again with its forward scales, tensorwise; by rows
    along N, the others); dW[e] = x_eᵀ dy_e of x's kept copy and dy, each
    scaled over the group's rows (tensorwise: their one scale). No gradient
    for the offsets. Scales and reductions: the module docstring.
    """
    if scaling.recipe == "tensorwise":
        return _Fp8GroupedMM.apply(x, weight, offs, scaling)
    return _ContractionScaledGroupedMM.apply(x, weight, offs, scaling)


@torch.library.custom_op("ptc::fp8_grouped_gemm", mutates_args=())
def fp8_grouped_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                     offs: torch.Tensor, out_dtype: torch.dtype, recipe: str,
                     emulate: bool) -> torch.Tensor:
    """Each group e of rows of (a·sa) [M, K] times (b[e]·sb[e]) [K, N], of float8 `a` and
    `b` [E, K, N] with scales that broadcast (or, mxfp8, repeat by blocks) over them,
    accumulated in fp32, as `out_dtype`; rows past the last group are zero.

    One op to the dispatcher, as a grouped GEMM is one kernel: a saving checkpoint region
    (`ptc.ops.recompute.SAVED_OPS`) keeps its output."""
    if _on_fp8_kernel(a, sa, b, out_dtype, recipe, emulate):
        experts, n = b.shape[0], b.shape[2]
        return torch._scaled_grouped_mm(
            a.contiguous(), _column_major(b),
            sa.float().expand(a.shape[0], 1).reshape(-1).contiguous(),
            sb.float().expand(experts, 1, n).reshape(experts, n).contiguous(),
            offs=torch.cumsum(expert_counts(offs), 0).to(torch.int32), out_dtype=out_dtype)
    out = a.new_zeros((a.shape[0], b.shape[2]), dtype=torch.float32)
    da = a.float() * expand_scale(sa, a.shape)
    db = b.float() * expand_scale(sb, b.shape)
    for expert, (start, end) in enumerate(_bounds(offs)):
        out[start:end] = da[start:end] @ db[expert]
    return out.to(out_dtype)


@fp8_grouped_gemm.register_fake
def _fp8_grouped_gemm_shape(a, sa, b, sb, offs, out_dtype, recipe, emulate):
    return a.new_empty((a.shape[0], b.shape[2]), dtype=out_dtype)


def _on_fp8_kernel(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor,
                   out_dtype: torch.dtype, recipe: str, emulate: bool) -> bool:
    """Whether `torch._scaled_grouped_mm` takes this product (module docstring); refuses a
    device without the recipe's float8 matmuls unless emulated, as a linear does."""
    if emulate or a.is_meta:
        return False
    if not device_has_fp8(a.device, recipe):
        raise RuntimeError(no_fp8_reason(a.device, recipe))
    return device_has_fp8(a.device, "rowwise") and a.dtype == b.dtype == E4M3 \
        and sa.dtype == torch.float32 and out_dtype == torch.bfloat16 \
        and a.shape[1] % 16 == 0 and b.shape[2] % 16 == 0


def _column_major(b: torch.Tensor) -> torch.Tensor:
    """`b` with each matrix stored column by column, as cuBLAS takes a second operand."""
    return b.transpose(-2, -1).contiguous().transpose(-2, -1)


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    """(first row, end row) of each group, from the cumulative ends `offs` (host values)."""
    ends = torch.cumsum(expert_counts(offs), 0).tolist()
    return list(zip([0, *ends[:-1]], ends))


def row_segments(offs: torch.Tensor, rows: int, recipe: str) -> tuple[torch.Tensor, int]:
    """(segment of each of `rows` rows, segments): what the weight gradient scales by column
    together. rowwise: a segment per group; mxfp8: per block of MX_BLOCK rows of a group,
    its last block what is left. Every row is taken to lie in a group (offs[-1] = rows, as
    in every graph ptc lowers); one past them counts with the last."""
    counts = expert_counts(offs)
    ends = torch.cumsum(counts, 0)
    position = torch.arange(rows, device=counts.device)
    group = torch.searchsorted(ends, position, right=True).clamp(max=counts.numel() - 1)
    if recipe == "rowwise":
        return group, counts.numel()
    blocks = (counts + MX_BLOCK - 1) // MX_BLOCK
    total = -(-rows // MX_BLOCK) if offs.is_meta else int(blocks.sum())
    segment = (torch.cumsum(blocks, 0) - blocks)[group] + (position - (ends - counts)[group]) \
        // MX_BLOCK
    return segment.clamp(max=max(total - 1, 0)), total


def quantize_groups(t: torch.Tensor, offs: torch.Tensor, recipe: str
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 values, scales, each row's segment) of `t` [M, C] scaled by column within each
    segment of its rows (`row_segments`): rowwise one fp32 scale per group and column
    [E, C], mxfp8 one E8M0 scale per block and column [blocks, C]."""
    segment, total = row_segments(offs, t.shape[0], recipe)
    magnitude = t.detach().abs().float()
    amax = magnitude.new_zeros((total, t.shape[1])).scatter_reduce_(
        0, segment[:, None].expand_as(magnitude), magnitude, "amax")
    scale = scale_of(amax, E4M3) if recipe == "rowwise" else mx_scale(amax)
    return quantize(t, scale.float()[segment], E4M3), scale, segment


def _weight_grad(xc: torch.Tensor, sx: torch.Tensor, gc: torch.Tensor, sg: torch.Tensor,
                 offs: torch.Tensor, segment: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """dW [E, K, N]: each group's x_eᵀ dy_e of x's float8 copy `xc` [M, K] and dy's `gc`
    [M, N], whose scales `sx`, `sg` are one each (`segment` None) or one per column of each
    of the rows' segments (`row_segments`), multiplied dequantised in fp32 group by group
    (module docstring)."""
    dx = xc.float() * (sx.float() if segment is None else sx.float()[segment])
    dg = gc.float() * (sg.float() if segment is None else sg.float()[segment])
    out = dx.new_zeros((offs.shape[0], xc.shape[1], gc.shape[1]))
    for expert, (start, end) in enumerate(_bounds(offs)):
        out[expert] = dx[start:end].t() @ dg[start:end]
    return out.to(out_dtype)


class _Fp8GroupedMM(torch.autograd.Function):
    """The tensorwise recipe: one scale for x, for dy, and for each expert's weight."""

    @staticmethod
    def forward(ctx, x, weight, offs, scaling):  # noqa: D102 - autograd.Function protocol
        sx = scaling.scale(INPUT, x)
        sw = scaling.expert_scales(weight).reshape(-1, 1, 1)
        xq = quantize(x, sx, E4M3)
        out = fp8_grouped_gemm(xq, sx, quantize(weight, sw, E4M3), sw, offs, x.dtype,
                               "tensorwise", scaling.emulate)
        ctx.save_for_backward(xq, sx, weight, sw, offs)
        ctx.scaling, ctx.x_dtype = scaling, x.dtype
        return out

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        xq, sx, weight, sw, offs = ctx.saved_tensors
        scaling = ctx.scaling
        sg = scaling.scale(GRAD, dy)
        gq = quantize(dy, sg, E5M2)
        wq = quantize(weight, sw, E4M3)  # the forward's bytes: same weight, same scales
        dx = fp8_grouped_gemm(gq, sg, wq.transpose(-2, -1), sw, offs, ctx.x_dtype,
                              "tensorwise", scaling.emulate)
        dw = _weight_grad(xq, sx, gq, sg, offs, None, weight.dtype)
        return dx, dw, None, None


class _ContractionScaledGroupedMM(torch.autograd.Function):
    """The rowwise and mxfp8 recipes: every operand scaled along each GEMM's contraction."""

    @staticmethod
    def forward(ctx, x, weight, offs, scaling):  # noqa: D102 - autograd.Function protocol
        recipe, split = scaling.recipe, scaling.split_group(ROW)
        xq, sx = quantize_along(x, 1, recipe, split)
        wq, sw = quantize_along(weight, 1, recipe, split)
        out = fp8_grouped_gemm(xq, sx, wq, sw, offs, x.dtype, recipe, scaling.emulate)
        xc, sxc, _ = quantize_groups(x, offs, recipe)
        ctx.save_for_backward(xc, sxc, weight, offs)
        ctx.scaling, ctx.x_dtype = scaling, x.dtype
        return out

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        xc, sxc, weight, offs = ctx.saved_tensors
        scaling = ctx.scaling
        recipe, split = scaling.recipe, scaling.split_group(COLUMN)
        gq, sg = quantize_along(dy, 1, recipe, split)
        wq, sw = quantize_along(weight, 2, recipe, split)
        dx = fp8_grouped_gemm(gq, sg, wq.transpose(-2, -1), sw.transpose(-2, -1), offs,
                              ctx.x_dtype, recipe, scaling.emulate)
        gc, sgc, segment = quantize_groups(dy, offs, recipe)  # x's rows, x's segments
        dw = _weight_grad(xc, sxc, gc, sgc, offs, segment, weight.dtype)
        return dx, dw, None, None
