"""`ptc.ops.fp8_grouped` against an fp64 reference of each recipe's float8 round trips.

The reference quantises by hand in fp64, per GEMM and per expert group, with each
recipe's rule (`ptc.ops.fp8_linear`'s module docstring): tensorwise one scale amax / 448
for x, one per expert's weight, amax / 57344 (e5m2) for dy; rowwise amax / 448 per row
or column along the GEMM's contraction dimension, the weight gradient's operands by
column within each expert's rows; mxfp8 2^(floor(log2(amax)) - 8) per block of 32 along
it, an expert's last block of rows what is left. The products of the dequantised operands
are fp64. The op's float8 values equal the reference's (`quantize_groups` exactly, scales
too); its products then differ from the fp64 ones only by fp32 arithmetic: dequantising
each operand (one rounding, and an fp32 scale, one more) and summing K products in fp32,
at most (K + 4)·2^-24·(|A|·|B|) element by element (Higham's γ bound for a dot product,
as `tests/ops/test_fp8_linear.py` derives it), |A|·|B| the product of the reference
operands' magnitudes, K the contraction's length (the weight gradient: an expert's rows).

The groups are uneven and one expert receives no row: its weight gradient is zero.
"""

from __future__ import annotations

import pytest
import torch

from ptc.ops.fp8_grouped import fp8_grouped_mm, quantize_groups
from ptc.ops.fp8_linear import Fp8Scaling, advance_amax_history

E4M3, E5M2, E8M0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu
RECIPES = ("tensorwise", "rowwise", "mxfp8")
U = 2.0**-24
SIZES = (45, 0, 3, 48)
"""Rows per expert: uneven, expert 1 receives none, groups of partial 32-row blocks."""
K, N = 64, 96
"""Contraction dimensions holding whole 32-element blocks (mxfp8)."""


def _tensors(seed: int = 0):
    """x [M, K] grouped by expert, the stack [E, K, N] (a transposed view of [E, N, K], as a
    model's [out, in] experts are read), dy [M, N], offsets; magnitudes spread over decades
    (a per-row or per-block scale has work to do)."""
    g = torch.Generator().manual_seed(seed)
    rows = sum(SIZES)
    x = torch.randn(rows, K, generator=g) * torch.logspace(-3, 2, K)
    w = (torch.randn(len(SIZES), N, K, generator=g) * 0.2
         * torch.logspace(0, -2, len(SIZES))[:, None, None]).transpose(-2, -1)
    dy = torch.randn(rows, N, generator=g) * 1e-3 * torch.logspace(0, 3, rows)[:, None]
    offs = torch.cumsum(torch.tensor(SIZES), 0).to(torch.int32)
    return x, w, dy, offs


def _groups():
    """(start, end) rows of each expert."""
    ends = torch.cumsum(torch.tensor(SIZES), 0).tolist()
    return list(zip([0, *ends[:-1]], ends))


def _dq(t: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype = E4M3) -> torch.Tensor:
    """`t` through `fmt` at `scale` (fp64, spread over t) and back."""
    top = torch.finfo(fmt).max
    return (t.double() / scale).clamp(-top, top).to(fmt).double() * scale


def _scale(amax: torch.Tensor, recipe: str, fmt: torch.dtype = E4M3) -> torch.Tensor:
    """The recipe's scale of blocks or lines whose largest magnitudes are `amax` (fp64)."""
    if recipe == "mxfp8":
        return 2.0 ** (torch.floor(torch.log2(amax)).clamp(-127 + 8, 127 + 8) - 8)
    return torch.where(amax > 0, amax / torch.finfo(fmt).max, torch.ones_like(amax))


def _along(t: torch.Tensor, dim: int, recipe: str) -> torch.Tensor:
    """`t` dequantised with scales along `dim` (rowwise: one per line; mxfp8: per 32)."""
    t = t.double()
    if recipe == "rowwise":
        return _dq(t, _scale(t.abs().amax(dim, keepdim=True), recipe))
    lines = t.abs().movedim(dim, -1)
    amax = lines.reshape(*lines.shape[:-1], -1, 32).amax(-1)
    return _dq(t, _scale(amax, recipe).repeat_interleave(32, -1).movedim(-1, dim))


def _group_scales(t: torch.Tensor, recipe: str) -> torch.Tensor:
    """fp64 scales of `t` [M, C], spread over it, by column within each expert's rows
    (mxfp8: blocks of 32 of them, the last what is left)."""
    t = t.double()
    scale = torch.ones_like(t)
    for start, end in _groups():
        size = 32 if recipe == "mxfp8" else max(end - start, 1)
        for first in range(start, end, size):
            block = slice(first, min(first + size, end))
            scale[block] = _scale(t[block].abs().amax(0, keepdim=True), recipe)
    return scale


def _by_groups(t: torch.Tensor, recipe: str) -> torch.Tensor:
    """`t` dequantised with `_group_scales`."""
    return _dq(t, _group_scales(t, recipe))


def _reference(x, w, dy, recipe):
    """(y, dx, dw) of the recipe in fp64, each with its bound (module docstring)."""
    if recipe == "tensorwise":
        xd = _dq(x, _scale(x.double().abs().amax(), recipe))
        gd = _dq(dy, _scale(dy.double().abs().amax(), recipe, E5M2), E5M2)
        wd = _dq(w, _scale(w.double().abs().amax(dim=(1, 2), keepdim=True), recipe))
        pairs = ((xd, wd), (gd, wd), (xd, gd))
    else:
        pairs = ((_along(x, 1, recipe), _along(w, 1, recipe)),
                 (_along(dy, 1, recipe), _along(w, 2, recipe)),
                 (_by_groups(x, recipe), _by_groups(dy, recipe)))
    (xa, wa), (ga, wb), (xc, gc) = pairs
    y = torch.zeros(x.shape[0], N, dtype=torch.float64)
    dx, dw = torch.zeros_like(x, dtype=torch.float64), torch.zeros_like(w, dtype=torch.float64)
    bounds = [torch.zeros_like(t) for t in (y, dx, dw)]
    for e, (start, end) in enumerate(_groups()):
        rows = slice(start, end)
        for out, bound, a, b, k in ((y, bounds[0], xa[rows], wa[e], K),
                                    (dx, bounds[1], ga[rows], wb[e].t(), N)):
            out[rows], bound[rows] = a @ b, (k + 4) * U * (a.abs() @ b.abs())
        dw[e] = xc[rows].t() @ gc[rows]
        bounds[2][e] = (end - start + 4) * U * (xc[rows].abs().t() @ gc[rows].abs())
    return list(zip((y, dx, dw), bounds))


def _run(scaling, x, w, dy, offs):
    x, w = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fp8_grouped_mm(x, w, offs, scaling)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _scaling(recipe: str, *, delayed: bool = False, emulate: bool = True) -> Fp8Scaling:
    return Fp8Scaling(delayed=delayed, window=2, emulate=emulate, axis=None, recipe=recipe,
                      experts=len(SIZES))


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_gemm_equals_its_fp64_reference_within_the_fp32_bound(recipe):
    x, w, dy, offs = _tensors()
    got = _run(_scaling(recipe), x, w, dy, offs)
    for name, value, (want, bound) in zip(("y", "dx", "dw"), got, _reference(x, w, dy, recipe)):
        assert value.shape == want.shape, name
        excess = (value.double() - want).abs() - bound
        assert excess.max() <= 0, f"{recipe} {name}: beyond the bound by {excess.max():.3g}"
    assert not got[2][1].any(), "the expert that received no row has a weight gradient"
    # Not the unquantised product: float8 keeps 3 mantissa bits.
    assert (got[0] - torch._grouped_mm(x, w, offs)).abs().max() > 1e-3


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_weight_gradient_copies_scale_each_experts_rows_apart(recipe):
    """`quantize_groups`: the float8 bytes and scales of the fp64 rule, an E8M0 scale per
    block of an expert's rows (its last one partial) or an fp32 scale per expert."""
    x, _, _, offs = _tensors()
    q, scale, _ = quantize_groups(x, offs, recipe)
    want = _group_scales(x, recipe)
    assert torch.equal(q.view(torch.uint8),
                       (x.double() / want).clamp(-448, 448).to(E4M3).view(torch.uint8))
    torch.testing.assert_close(_expanded(scale, recipe).double(), want,
                               rtol=0 if recipe == "mxfp8" else U, atol=0)
    blocks = sum(-(-size // 32) for size in SIZES)  # 2 + 0 + 1 + 2
    assert scale.shape == ((blocks, K) if recipe == "mxfp8" else (len(SIZES), K))
    assert scale.dtype == (E8M0 if recipe == "mxfp8" else torch.float32)


def _expanded(scale: torch.Tensor, recipe: str) -> torch.Tensor:
    """Per-row scales of `_tensors`' rows from `quantize_groups`'s (module docstring)."""
    rows = []
    for segment, (start, end) in enumerate(_groups()):
        if recipe == "rowwise":
            rows += [scale[segment].float()] * (end - start)
    if recipe == "mxfp8":
        block = 0
        for start, end in _groups():
            for first in range(start, end, 32):
                rows += [scale[block].float()] * (min(first + 32, end) - first)
                block += 1
    return torch.stack(rows)


def test_delayed_scaling_keeps_a_history_row_per_expert():
    """The input's, each expert weight's and the output gradient's amax, in that order; the
    next step scales with them (a value beyond them saturates)."""
    x, w, dy, offs = _tensors()
    scaling = _scaling("tensorwise", delayed=True)
    first = _run(scaling, x, w, dy, offs)
    torch.testing.assert_close(scaling.pending, torch.cat([
        x.abs().max().reshape(1), w.abs().amax(dim=(1, 2)), dy.abs().max().reshape(1)]))
    advance_amax_history(scaling)
    again = _run(scaling, x, w, dy, offs)  # the same tensors: the history's scales are theirs
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    smaller = _run(scaling, x * 0.25, w, dy, offs)  # scaled by the history, not its own amax
    current = _run(_scaling("tensorwise"), x * 0.25, w, dy, offs)
    assert not torch.equal(smaller[0], current[0])


def test_what_backward_keeps():
    """x's float8 copy and its scales (tensorwise: x's and one per expert's weight; rowwise:
    one fp32 per expert and column; mxfp8: one E8M0 byte per block and column), besides the
    weight (a parameter) and the offsets."""
    x, w, _, offs = _tensors()
    experts, blocks = len(SIZES), sum(-(-size // 32) for size in SIZES)
    scales = {"tensorwise": [(str(torch.float32), 4), (str(torch.float32), 4 * experts)],
              "rowwise": [(str(torch.float32), 4 * experts * K)],
              "mxfp8": [(str(E8M0), blocks * K)]}
    for recipe, kept_scales in scales.items():
        saved = []
        weight = w.detach().clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            fp8_grouped_mm(x.clone().requires_grad_(), weight, offs, _scaling(recipe))
        kinds = sorted((str(t.dtype), t.numel() * t.element_size()) for t in saved
                       if t is not weight and t.dtype != torch.int32)
        assert kinds == sorted([(str(E4M3), x.numel()), *kept_scales]), (recipe, kinds)


@pytest.mark.parametrize("recipe, refusal", [
    ("tensorwise", "no float8 matmuls .* set train.fp8_emulate = true"),
    ("rowwise", "no rowwise-scaled float8 matmuls .* 9.0"),
    ("mxfp8", "mxfp8 runs emulated only")])
def test_without_emulation_a_cpu_refuses_in_one_line(recipe, refusal):
    x, w, dy, offs = _tensors()
    with pytest.raises(RuntimeError, match=refusal):
        _run(_scaling(recipe, emulate=False), x, w, dy, offs)
