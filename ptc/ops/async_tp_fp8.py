"""Collective matmuls of float8 linears (`train.dtype = fp8` with `parallel.tp_comm = async`).

The ops of `ptc.ops.async_tp`, with each GEMM a float8 one scaled as
`ptc.ops.fp8_linear` scales it (`train.fp8_recipe`). A chunk of the sequence
is quantised with the scales of the whole tensor, so the float8 values are
those the unsplit linear would multiply:

- tensorwise: one scale per tensor, from its amax reduced (max) over tp,
  which is the whole sequence's amax;
- rowwise: a scale per line along the GEMM's contraction dimension; a line
  along the tokens (x's columns for the weight gradient, dy's) spans every
  chunk, so its amax is reduced over tp first; a line along the features
  lies in one chunk;
- mxfp8: blocks of 32 along the contraction dimension; blocks along the
  tokens lie in one chunk, since a rank's chunk holds whole blocks (the
  quantize_gemms pass checks seq_len / (cp·tp)).

The chunks travel as their compute dtype (what the unsplit op gathers);
what backward keeps of the input is each linear's float8 column copy of
the rank's chunk, which travels round the ring again as bytes. Weight
gradients add up chunk by chunk in fp32.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ptc.ops.async_tp import Ring, ring_gather_map, ring_reduce_scatter
from ptc.ops.comm import axis_group
from ptc.ops.fp8_linear import (COLUMN, E4M3, E5M2, GRAD, INPUT, ROW, WEIGHT, expand_scale,
                                fp8_gemm, quantize, quantize_along)
from ptc.ops.tp_ops import TP, _collective


def _chunk_rows(t: torch.Tensor, samples: int, chunk: int, parts: int) -> torch.Tensor:
    """Chunk `chunk` of `parts` along the sequence of a 2-D tensor whose rows are
    `samples` samples' tokens in order (or blocks of them); a tensor of one row (a
    column scale) or a scalar scale is every chunk's."""
    if t.dim() < 2 or t.shape[0] == 1:
        return t
    per_sample = t.shape[0] // samples
    size = per_sample // parts
    return t.view(samples, per_sample, -1)[:, chunk * size:(chunk + 1) * size].reshape(
        -1, t.shape[-1])


def _weight_forward(weight: torch.Tensor, scaling) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward GEMM's right operand and its scale: Wᵀ in e4m3."""
    if scaling.recipe == "tensorwise":
        scale = scaling.scale(WEIGHT, weight)
        return quantize(weight, scale, E4M3).t(), scale
    wq, scale = quantize_along(weight, 1, scaling.recipe, scaling.split_group(ROW))
    return wq.t(), scale.t()


def _weight_dgrad(weight: torch.Tensor, scaling, forward_scale: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The input gradient's right operand and its scale: W in e4m3 (tensorwise: the
    forward's bytes, quantised again with its scale)."""
    if scaling.recipe == "tensorwise":
        return quantize(weight, forward_scale, E4M3), forward_scale
    return quantize_along(weight, 0, scaling.recipe, scaling.split_group(COLUMN))


def _lhs(t2: torch.Tensor, scaling, which: int, scale: torch.Tensor | None, role: str
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """A GEMM's left operand [rows, K] in float8, scaled along K: tensorwise with `scale`
    (the whole tensor's), else per row (reduced over tp where `role` splits K)."""
    if scaling.recipe == "tensorwise":
        return quantize(t2, scale, E5M2 if which == GRAD else E4M3), scale
    return quantize_along(t2, 1, scaling.recipe, scaling.split_group(role))


def _column_copy(t2: torch.Tensor, scaling, scale: torch.Tensor | None, group
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The input chunk `t2` [tokens, K] scaled along its tokens, what the weight gradient
    contracts: the tensorwise copy with `scale`; rowwise with column scales over every
    chunk's tokens (reduced over `group`); mxfp8 with the chunk's own blocks."""
    if scaling.recipe == "tensorwise":
        return quantize(t2, scale, E4M3), scale
    return quantize_along(t2, 0, scaling.recipe, group if scaling.recipe == "rowwise" else None)


def _as_bytes(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple]]:
    """Tensors as one flat byte buffer, and how to take them apart again (`_from_bytes`)."""
    flat = [t.contiguous().view(-1).view(torch.uint8) for t in tensors]
    return torch.cat(flat), [(t.shape, t.dtype, f.numel()) for t, f in zip(tensors, flat)]


def _from_bytes(buffer: torch.Tensor, layout: list[tuple]) -> list[torch.Tensor]:
    """The tensors `_as_bytes` packed into `buffer`."""
    out, start = [], 0
    for shape, dtype, size in layout:
        out.append(buffer[start:start + size].clone().view(dtype).view(shape))  # aligned
        start += size
    return out


class _AllGatherFp8Linears(torch.autograd.Function):
    """Inputs: x, axis, dim, scalings, has_bias, *weights, *present biases."""

    @staticmethod
    def forward(ctx, x, axis, dim, scalings, has_bias, *params):  # noqa: D102
        n, k = len(has_bias), x.shape[-1]
        weights, present = params[:n], iter(params[n:])
        biases = [next(present) if flag else None for flag in has_bias]
        group = axis_group(axis)
        ring = Ring(group)
        rhs = [_weight_forward(w, s) for w, s in zip(weights, scalings)]
        whole = [s.scale(INPUT, x) if s.recipe == "tensorwise" else None for s in scalings]
        parts: list[list[torch.Tensor | None]] = [[None] * ring.size for _ in weights]

        def multiply(source: int, held: torch.Tensor) -> None:
            rows = held.reshape(-1, k)
            for i, (s, (wq, sw), b) in enumerate(zip(scalings, rhs, biases)):
                hq, sh = _lhs(rows, s, INPUT, whole[i], ROW)
                out = fp8_gemm(hq, sh, wq, sw, b, x.dtype, s.emulate)
                parts[i][source] = out.reshape(*held.shape[:-1], wq.shape[1])

        ring_gather_map(ring, x, multiply)
        copies = [_column_copy(x.reshape(-1, k), s, whole[i], group)
                  for i, s in enumerate(scalings)]
        # tensorwise quantises W again with the forward's scale; the others need none
        scales = [sw if s.recipe == "tensorwise" else None for s, (_, sw) in zip(scalings, rhs)]
        ctx.save_for_backward(*weights, *(t for c in copies for t in c), *scales)
        ctx.axis, ctx.dim, ctx.scalings, ctx.x_shape, ctx.x_dtype = axis, dim, scalings, \
            x.shape, x.dtype
        ctx.biased = [i for i, flag in enumerate(has_bias) if flag]
        return tuple(torch.cat(out, dim) for out in parts)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):  # noqa: D102
        n, saved = len(ctx.scalings), ctx.saved_tensors
        weights, copies, scales = saved[:n], saved[n:3 * n], saved[3 * n:]
        group = axis_group(ctx.axis)
        ring, dim, samples = Ring(group), ctx.dim, ctx.x_shape[0]
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[5:5 + n]
        need_b = ctx.needs_input_grad[5 + n:]
        flat = [g.reshape(-1, g.shape[-1]) for g in grads]
        whole = [s.scale(GRAD, g) if s.recipe == "tensorwise" else None
                 for g, s in zip(flat, ctx.scalings)]
        lhs = [_lhs(g, s, GRAD, sg, COLUMN) for g, s, sg in zip(flat, ctx.scalings, whole)]
        grad_x = None
        if need_x:
            rhs = [_weight_dgrad(w, s, sw) for w, s, sw in zip(weights, ctx.scalings, scales)]

            def partial(c: int) -> torch.Tensor:
                total = None
                for (gq, sg), (wq, sw), s in zip(lhs, rhs, ctx.scalings):
                    out = fp8_gemm(_chunk_rows(gq, samples, c, ring.size),
                                   _chunk_rows(sg, samples, c, ring.size), wq, sw, None,
                                   ctx.x_dtype, s.emulate)
                    total = out if total is None else total + out
                return total.view(samples, -1, total.shape[-1])

            grad_x = ring_reduce_scatter(ring, partial)
            if dim != 1:
                grad_x = grad_x.movedim(1, dim)
        grad_w: list[torch.Tensor | None] = [None] * n
        if any(need_w):
            # dy's columns: the tensorwise e5m2 copy, else scaled along the tokens, which
            # every rank holds whole (its columns are its own features: nothing to reduce)
            cols = [q if s.recipe == "tensorwise" else quantize_along(g, 0, s.recipe)
                    for q, g, s in zip(lhs, flat, ctx.scalings)]
            own, layout = _as_bytes(list(copies))
            sums = [None] * n

            def accumulate(source: int, held: torch.Tensor) -> None:
                parts = _from_bytes(held, layout)
                for i, s in enumerate(ctx.scalings):
                    if not need_w[i]:
                        continue
                    gc, sgc = cols[i]
                    xc, sxc = parts[2 * i], parts[2 * i + 1]
                    lhs = _chunk_rows(gc, samples, source, ring.size).t()
                    lhs_scale = _chunk_rows(sgc, samples, source, ring.size)
                    out = fp8_gemm(lhs, lhs_scale.t() if lhs_scale.dim() == 2 else lhs_scale,
                                   xc, sxc, None, torch.float32, s.emulate)
                    sums[i] = out if sums[i] is None else sums[i].add_(out)

            ring_gather_map(ring, own, accumulate)
            grad_w = [t.to(w.dtype) if t is not None else None for t, w in zip(sums, weights)]
        grad_b = [grads[i].reshape(-1, grads[i].shape[-1]).sum(0) if need else None
                  for i, need in zip(ctx.biased, need_b)]
        return (grad_x, None, None, None, None, *grad_w, *grad_b)


@_collective("all-gather in ring steps beside the float8 GEMMs",
             "reduce-scatter and all-gather in ring steps beside the float8 GEMMs")
def all_gather_fp8_linears(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                           biases: tuple[torch.Tensor | None, ...], scalings: tuple,
                           dim: int = 1, axis: str = TP) -> tuple[torch.Tensor, ...]:
    """`ptc.ops.async_tp.all_gather_linears` of float8 linears, each scaled by its own
    `Fp8Scaling` (module docstring). The sequence dimension `dim` is 1: [samples, tokens,
    features]."""
    if not (len(weights) == len(biases) == len(scalings)) or not weights:
        raise ValueError(f"all_gather_fp8_linears: {len(weights)} weights, {len(biases)} "
                         f"biases and {len(scalings)} scalings; give one of each per linear")
    if dim != 1 or x.dim() != 3:
        raise ValueError(f"all_gather_fp8_linears: a [samples, tokens, features] input split "
                         f"along dim 1, got shape {tuple(x.shape)} split along {dim}")
    has_bias = tuple(b is not None for b in biases)
    return _AllGatherFp8Linears.apply(x, axis, dim, tuple(scalings), has_bias, *weights,
                                      *(b for b in biases if b is not None))


class _Fp8LinearReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, scaling, dim, axis):  # noqa: D102
        group = axis_group(axis)
        ring, samples, k = Ring(group), x.shape[0], x.shape[-1]
        wq, sw = _weight_forward(weight, scaling)
        rows = x.reshape(-1, k)
        whole = scaling.scale(INPUT, x) if scaling.recipe == "tensorwise" else None
        xq, sx = _lhs(rows, scaling, INPUT, whole, ROW)

        def partial(c: int) -> torch.Tensor:
            out = fp8_gemm(_chunk_rows(xq, samples, c, ring.size),
                           _chunk_rows(sx, samples, c, ring.size), wq, sw, None, x.dtype,
                           scaling.emulate)
            return out.view(samples, -1, out.shape[-1])

        out = ring_reduce_scatter(ring, partial)
        if scaling.recipe == "tensorwise":
            xc, sxc = xq, sx
        else:
            xc, sxc = quantize_along(rows, 0, scaling.recipe)
        ctx.save_for_backward(weight, xc, sxc, sw if scaling.recipe == "tensorwise" else None)
        ctx.scaling, ctx.axis, ctx.x_shape, ctx.x_dtype = scaling, axis, x.shape, x.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # noqa: D102
        weight, xc, sxc, sw = ctx.saved_tensors
        scaling, group = ctx.scaling, axis_group(ctx.axis)
        ring, samples = Ring(group), ctx.x_shape[0]
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        tensorwise = scaling.recipe == "tensorwise"
        whole = scaling.scale(GRAD, grad) if tensorwise else None
        column = None
        if not tensorwise and scaling.recipe == "rowwise":  # dy's columns span every chunk
            _, column = quantize_along(grad.reshape(-1, grad.shape[-1]), 0, "rowwise", group)
        wq, swq = _weight_dgrad(weight, scaling, sw)
        parts: list[torch.Tensor | None] = [None] * ring.size
        total = [None]

        def use(source: int, held: torch.Tensor) -> None:
            rows = held.reshape(-1, held.shape[-1])
            if need_x:
                gq, sg = _lhs(rows, scaling, GRAD, whole, COLUMN)
                out = fp8_gemm(gq, sg, wq, swq, None, ctx.x_dtype, scaling.emulate)
                parts[source] = out.view(*held.shape[:-1], out.shape[-1])
            if need_w:
                if tensorwise:
                    gc, sgc = quantize(rows, whole, E5M2), whole
                elif column is not None:
                    gc, sgc = quantize(rows, expand_scale(column, rows.shape), E4M3), column
                else:
                    gc, sgc = quantize_along(rows, 0, scaling.recipe)
                out = fp8_gemm(gc.t(), sgc.t() if sgc.dim() == 2 else sgc,
                               _chunk_rows(xc, samples, source, ring.size),
                               _chunk_rows(sxc, samples, source, ring.size), None,
                               torch.float32, scaling.emulate)
                total[0] = out if total[0] is None else total[0].add_(out)

        ring_gather_map(ring, grad, use)
        grad_x = torch.cat(parts, 1) if need_x else None
        grad_w = total[0].to(weight.dtype) if need_w else None
        return grad_x, grad_w, None, None, None


@_collective("reduce-scatter in ring steps beside the float8 GEMMs",
             "all-gather in ring steps beside the float8 GEMMs")
def fp8_linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, scaling, dim: int = 1,
                              axis: str = TP) -> torch.Tensor:
    """`ptc.ops.async_tp.linear_reduce_scatter` of a float8 row-parallel linear scaled by
    `scaling` (module docstring); `dim` is 1: [samples, tokens, features]."""
    if dim != 1 or x.dim() != 3:
        raise ValueError(f"fp8_linear_reduce_scatter: a [samples, tokens, features] input "
                         f"reduce-scattered along dim 1, got shape {tuple(x.shape)}, dim {dim}")
    return _Fp8LinearReduceScatter.apply(x, weight, scaling, dim, axis)
