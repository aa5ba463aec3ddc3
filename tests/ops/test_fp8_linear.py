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
