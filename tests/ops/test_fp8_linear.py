"""`ptc.ops.fp8_linear` against a float reference built from explicit float8 round trips.

The reference quantises by hand: a tensor's scale is amax / 448 (e4m3: input and weight)
or amax / 57344 (e5m2: output gradient), its float8 value `(t / scale).to(float8)`,
dequantised `.float() * scale`; the products are fp32 matmuls of the dequantised
operands. The emulated op must give the same numbers (up to fp32 summation order: the
default fp32 tolerance), in forward and backward; delayed scaling must use the amax of
earlier steps (a case current scaling gets wrong), and forget it after the window. On a
GPU with float8 matmuls the real `torch._scaled_mm` path must agree with emulation to the
bf16 rounding of its output.
"""

from __future__ import annotations

import pytest
import torch

from ptc.ops.fp8_linear import Fp8Scaling, advance_amax_history, device_has_fp8, fp8_linear

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _dq(t: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """`t` through `fmt` and back, at `scale`."""
    top = torch.finfo(fmt).max
    return (t / scale).clamp(-top, top).to(fmt).float() * scale


def _reference(x, w, b, dy, sx, sw, sg):
    xd, wd, gd = _dq(x, sx, E4M3), _dq(w, sw, E4M3), _dq(dy, sg, E5M2)
    x2, g2 = xd.reshape(-1, x.shape[-1]), gd.reshape(-1, dy.shape[-1])
    y = (x2 @ wd.t()).reshape(*x.shape[:-1], -1) + b
    return y, (g2 @ wd).reshape(x.shape), g2.t() @ x2, dy.reshape(-1, dy.shape[-1]).sum(0)


def _run(scaling, x, w, b, dy):
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = fp8_linear(x, w, b, scaling)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


def _tensors(seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 32, generator=g) * scale
    w = torch.randn(16, 32, generator=g) * 0.2
    b = torch.randn(16, generator=g)
    dy = torch.randn(2, 5, 16, generator=g) * 1e-3
    return x, w, b, dy


def _scale(t, fmax):
    return t.abs().max() / fmax


def test_current_scaling_equals_the_hand_quantised_reference():
    x, w, b, dy = _tensors()
    got = _run(Fp8Scaling(delayed=False, window=4, emulate=True, axis=None), x, w, b, dy)
    want = _reference(x, w, b, dy, _scale(x, 448), _scale(w, 448), _scale(dy, 57344))
    for name, g, r in zip(("y", "dx", "dw", "db"), got, want):
        torch.testing.assert_close(g, r, msg=lambda m, name=name: f"{name}: {m}")
    # Not the unquantised product: e4m3 keeps 3 mantissa bits.
    assert (got[0] - (x @ w.t() + b)).abs().max() > 1e-3


def test_delayed_scaling_takes_the_history_of_earlier_steps():
    scaling = Fp8Scaling(delayed=True, window=2, emulate=True, axis=None)
    x, w, b, dy = _tensors()
    first = _run(scaling, x, w, b, dy)  # empty history: current scaling
    want = _reference(x, w, b, dy, _scale(x, 448), _scale(w, 448), _scale(dy, 57344))
    torch.testing.assert_close(first[0], want[0])
    assert advance_amax_history(scaling) == 1
    x2, _, _, dy2 = _tensors(seed=1, scale=0.3)  # smaller: its own amax would scale it finer
    sx, sg = _scale(x, 448), _scale(dy, 57344)  # the history's, not their own
    got = _run(scaling, x2, w, b, dy2)
    delayed = _reference(x2, w, b, dy2, sx, _scale(w, 448), sg)
    current = _reference(x2, w, b, dy2, _scale(x2, 448), _scale(w, 448), _scale(dy2, 57344))
    for name, g, r in zip(("y", "dx", "dw"), got, delayed):
        torch.testing.assert_close(g, r, msg=lambda m, name=name: f"{name}: {m}")
    assert not torch.allclose(got[0], current[0]) and not torch.allclose(got[2], current[2])
    # After `window` steps of the small input, the first step's amax is forgotten.
    advance_amax_history(scaling)
    _run(scaling, x2, w, b, dy2)
    advance_amax_history(scaling)
    got = _run(scaling, x2, w, b, dy2)
    torch.testing.assert_close(got[0], current[0])


def test_delayed_scaling_saturates_a_value_beyond_the_history():
    scaling = Fp8Scaling(delayed=True, window=4, emulate=True, axis=None)
    x, w, b, dy = _tensors()
    _run(scaling, x, w, b, dy)
    advance_amax_history(scaling)
    big = x * 3
    got = _run(scaling, big, w, b, dy)
    want = _reference(big, w, b, dy, _scale(x, 448), _scale(w, 448), _scale(dy, 57344))
    torch.testing.assert_close(got[0], want[0])


def test_a_recomputed_forward_records_the_same_amax():
    scaling = Fp8Scaling(delayed=True, window=4, emulate=True, axis=None)
    x, w, b, dy = _tensors()
    _run(scaling, x, w, b, dy)
    pending = scaling.pending.clone()
    _run(scaling, x, w, b, dy)  # a second micro-batch or a recomputation
    torch.testing.assert_close(scaling.pending, pending, rtol=0, atol=0)
    torch.testing.assert_close(pending, torch.stack([x.abs().max(), w.abs().max(),
                                                     dy.abs().max()]))


def test_without_emulation_a_cpu_refuses_in_one_line():
    x, w, b, dy = _tensors()
    with pytest.raises(RuntimeError, match="no float8 matmuls .* set train.fp8_emulate = true"):
        _run(Fp8Scaling(delayed=False, window=4, emulate=False, axis=None), x, w, b, dy)


@pytest.mark.gpu
@pytest.mark.skipif(not device_has_fp8("cuda"), reason="needs a GPU with float8 matmuls")
def test_scaled_mm_agrees_with_emulation():
    x, w, b, dy = (t.to("cuda", torch.bfloat16) for t in _tensors())
    x, dy = x.reshape(-1, 32).repeat(4, 1)[:32], dy.reshape(-1, 16).repeat(4, 1)[:32]
    real = _run(Fp8Scaling(delayed=False, window=4, emulate=False, axis=None), x, w, b, dy)
    emulated = _run(Fp8Scaling(delayed=False, window=4, emulate=True, axis=None), x, w, b, dy)
    for name, g, r in zip(("y", "dx", "dw", "db"), real, emulated):
        # Both round the same fp32 sums of the same float8 products to bf16: one ulp apart.
        torch.testing.assert_close(g.float(), r.float(), rtol=2**-7, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


# ---------------------------------------------------------------- rowwise and mxfp8
#
# Each recipe against its own reference: every operand quantised with the recipe's rule in
# fp64 (rowwise: scale amax / 448 per row or column along the GEMM's contraction dimension;
# mxfp8: 2^(floor(log2(amax)) - 8) per block of 32 along it, OCP MX), the products of the
# dequantised operands in fp64. The op's float8 values must equal the reference's exactly
# (`quantize_along`); its scales too for mxfp8 (powers of two), and within one fp32
# rounding (2^-24 relative) for rowwise, whose scales are fp32. Its products then differ
# from the fp64 ones only by fp32 arithmetic: dequantising each operand (one rounding, and
# rowwise's fp32 scale, one more) and summing K products in fp32, at most
# (K + 4)·2^-24·(|A|·|B|) element by element (Higham's γ bound for a dot product), where
# |A|·|B| is the product of the reference operands' magnitudes.

RECIPES = ("rowwise", "mxfp8")
U = 2.0**-24


def _ref_quantize(t: torch.Tensor, dim: int, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp64 scales spread over t) of 2-D `t`, scaled along `dim` in fp64."""
    t = t.double()
    if recipe == "rowwise":
        amax = t.abs().amax(dim, keepdim=True)
        scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax)).expand_as(t)
    else:
        lines = t.abs().movedim(dim, -1)
        amax = lines.reshape(*lines.shape[:-1], -1, 32).amax(-1)
        exponent = torch.floor(torch.log2(amax)).clamp(-127 + 8, 127 + 8) - 8
        scale = (2.0**exponent).repeat_interleave(32, -1).movedim(-1, dim)
    return (t / scale).clamp(-448, 448).to(E4M3), scale


def _ref_gemm(a, a_dim, b, b_dim, recipe):
    """The fp64 product of `a` and `b` quantised along their contraction dims, and its bound
    (module comment): (product, (K + 4)·2^-24·|A|·|B|)."""
    qa, sa = _ref_quantize(a, a_dim, recipe)
    qb, sb = _ref_quantize(b, b_dim, recipe)
    da, db = qa.double() * sa, qb.double() * sb
    return da @ db, (a.shape[1] + 4) * U * (da.abs() @ db.abs())


def _ref_linear(x, w, b, dy, recipe):
    """y, dx, dw, db of the recipe's three GEMMs in fp64, each with its bound."""
    x2, g2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    y, y_bound = _ref_gemm(x2, 1, w.t(), 0, recipe)
    dx, dx_bound = _ref_gemm(g2, 1, w, 0, recipe)
    dw, dw_bound = _ref_gemm(g2.t(), 1, x2, 0, recipe)
    y = y + b.double()
    db = g2.double().sum(0), (g2.shape[0] + 1) * U * g2.double().abs().sum(0)  # fp32 sum
    return (y, y_bound + U * y.abs()), (dx, dx_bound), (dw, dw_bound), db


def _recipe_tensors(seed=0):
    """Operands whose every contraction dimension (K 64, N 96, M 2·32) holds whole blocks,
    with magnitudes spread over decades (a per-row or per-block scale has work to do)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 32, 64, generator=g) * torch.logspace(-3, 2, 64)
    w = torch.randn(96, 64, generator=g) * 0.2
    b = torch.randn(96, generator=g)
    dy = torch.randn(2, 32, 96, generator=g) * 1e-3 * torch.logspace(0, 3, 32)[:, None]
    return x, w, b, dy


def _scaling(recipe, emulate=True):
    return Fp8Scaling(delayed=False, window=1, emulate=emulate, axis=None, recipe=recipe)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dim", [0, 1])
def test_quantisation_equals_the_fp64_rule(recipe, dim):
    from ptc.ops.fp8_linear import expand_scale, quantize_along

    x = _recipe_tensors()[0].reshape(64, 64)
    q, scale = quantize_along(x, dim, recipe)
    ref_q, ref_scale = _ref_quantize(x, dim, recipe)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    spread = expand_scale(scale, x.shape).double().expand_as(x)
    rel = 0 if recipe == "mxfp8" else U
    torch.testing.assert_close(spread, ref_scale, rtol=rel, atol=0)
    assert scale.shape[dim] == (1 if recipe == "rowwise" else 2)
    assert scale.dtype == (torch.float32 if recipe == "rowwise" else torch.float8_e8m0fnu)


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_gemm_equals_its_fp64_reference_within_the_fp32_bound(recipe):
    x, w, b, dy = _recipe_tensors()
    got = _run(_scaling(recipe), x, w, b, dy)
    for name, value, (want, bound) in zip(("y", "dx", "dw", "db"), got,
                                          _ref_linear(x, w, b, dy, recipe)):
        excess = (value.double().reshape(want.shape) - want).abs() - bound
        assert excess.max() <= 0, f"{recipe} {name}: beyond the bound by {excess.max():.3g}"
    # Not tensorwise's numbers: its one scale per tensor rounds the same operands otherwise.
    tensorwise = _run(Fp8Scaling(delayed=False, window=1, emulate=True, axis=None), x, w, b, dy)
    assert not torch.equal(got[0], tensorwise[0]) and not torch.equal(got[2], tensorwise[2])


def test_mx_scale_follows_the_ocp_rule_at_powers_of_two():
    from ptc.ops.fp8_linear import mx_scale

    amax = torch.tensor([448.0, 511.0, 512.0, 1.0, 2.0**-130, 0.0])
    # floor(log2): 8, 8, 9, 0, -130 (clamped to E8M0's 2^-127), and 0 as the smallest.
    want = torch.tensor([1.0, 1.0, 2.0, 2.0**-8, 2.0**-127, 2.0**-127])
    torch.testing.assert_close(mx_scale(amax).float(), want, rtol=0, atol=0)


def test_rowwise_and_mxfp8_keep_the_column_copy_and_its_scales():
    """What backward holds: x's float8 column copy, its scales, and the weight (a
    parameter); rowwise's K fp32 scales, mxfp8's one E8M0 byte per 32 elements."""
    x, w, b, _ = _recipe_tensors()
    for recipe, scale_bytes in (("rowwise", 4 * 64), ("mxfp8", 64 * 64 // 32)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            fp8_linear(x.requires_grad_(), w.requires_grad_(), b, _scaling(recipe))
        kinds = sorted((str(t.dtype), t.numel() * t.element_size()) for t in saved
                       if t is not w)
        want = [(str(E4M3), 64 * 64), (str(_scale_dtype(recipe)), scale_bytes)]
        assert kinds == sorted(want), kinds


def _scale_dtype(recipe):
    return torch.float32 if recipe == "rowwise" else torch.float8_e8m0fnu


def test_mxfp8_refuses_a_gpu_and_rowwise_a_cpu_without_emulation():
    x, w, b, dy = _recipe_tensors()
    with pytest.raises(RuntimeError, match="mxfp8 runs emulated only .*fp8_emulate = true"):
        _run(_scaling("mxfp8", emulate=False), x, w, b, dy)
    with pytest.raises(RuntimeError, match="no rowwise-scaled float8 matmuls .* 9.0"):
        _run(_scaling("rowwise", emulate=False), x, w, b, dy)


@pytest.mark.gpu
@pytest.mark.skipif(not device_has_fp8("cuda", "rowwise"), reason="needs a CUDA GPU of capability 9.0 or more (rowwise float8 matmuls)")
def test_rowwise_scaled_mm_agrees_with_emulation():
    x, w, b, dy = (t.to("cuda", torch.bfloat16) for t in _recipe_tensors())
    real = _run(_scaling("rowwise", emulate=False), x, w, b, dy)
    emulated = _run(_scaling("rowwise"), x, w, b, dy)
    for name, g, r in zip(("y", "dx", "dw", "db"), real, emulated):
        # The same float8 operands and fp32 scales: cuBLAS scales the fp32 sums, emulation
        # the operands, so the sums differ by fp32 rounding; both round to bf16.
        torch.testing.assert_close(g.float(), r.float(), rtol=2**-7, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("seq_dim", [0, 1], ids=["seq-first", "batch-first"])
def test_sequence_chunks_keep_the_whole_sequences_column_copy(recipe, seq_dim):
    """Under sequence parallelism a rank keeps the column copy of its chunk of the gathered
    input (and mxfp8 its blocks' scales), joined in backward by the session's gather along
    the sequence: the joined bytes and scales are the unsplit copy's, exactly."""
    from ptc.ops.fp8_linear import _chunk_copy, quantize_along

    x = _recipe_tensors()[0].reshape(2, 64, 32).movedim(1, seq_dim).contiguous()
    want_q, want_scale = quantize_along(x.reshape(-1, 32), 0, recipe)
    kept = [_chunk_copy(x, chunk, recipe) for chunk in x.chunk(2, seq_dim)]
    joined = torch.cat([q for q, _ in kept], seq_dim).reshape(-1, 32)
    assert torch.equal(joined.view(torch.uint8), want_q.view(torch.uint8))
    scales = [s for _, s in kept]
    scale = scales[0] if recipe == "rowwise" else torch.cat(scales, seq_dim).reshape(-1, 32)
    assert torch.equal(scale.float(), want_scale.float())
