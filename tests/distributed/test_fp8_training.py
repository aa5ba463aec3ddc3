"""`train.dtype = fp8` (emulated) trains: with tp = 2 as without, and near bf16.

The tiny GPT and Llama (2 layers) train 5 AdamW steps in bf16 and in fp8 with
`fp8_emulate = true` (the layers' GEMMs on float8 operands, quantised and dequantised
exactly as `torch._scaled_mm` would take them), with delayed and with current scaling.

tp = 2 (with and without sequence parallelism) against tp = 1, both fp8: every amax is reduced over tp, so each rank quantises
with the whole tensor's scale and every element rounds to the same float8 value as
without tp; what differs is the order of the fp32/bf16 sums (a row-parallel GEMM sums
its halves after the all-reduce), as between tp = 2 and tp = 1 in bf16. So the bound is
the bf16 one: the losses (bf16 numbers near 4, one ulp = 2^-5) within 2 ulps, i.e.
2^-6 relative; and every parameter within 2·lr·steps of the other (Adam moves an element
by at most about lr a step, whatever its gradient: the bound that holds when a rounding
flip reverses the sign of a near-zero gradient). Measured: losses at most one bf16 ulp
apart (0.03125 at step 3-5), parameters at most 1.4e-2 apart (bound 3e-2), at most 1.7e-3
in a tensor's mean.

fp8 against bf16 (tp = 1): e4m3 keeps 3 mantissa bits, a relative rounding error of at
most 2^-4 per operand, so a GEMM's output moves by at most 2^-4 + 2^-4 = 2^-3 of the
sum of its products' magnitudes; the loss, a mean of log-softmaxes (1-Lipschitz in the
max-norm of the logits), moves by no more than the logits do. At initialisation the
logits of these models are O(1) (std ~0.3), so |L_fp8 - L_bf16| <= 2^-3 · L_bf16 is a
generous bound for every step; measured, they agree to one bf16 ulp (0.03125) or exactly.
"""

from __future__ import annotations

import pytest
from fp8_helpers import assert_trains_as_tp1, run_fp8_cases

from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed

CASES = [(f, tp, dtype, scaling) for f in ("gpt", "llama") for tp in (1, 2)
         for dtype, scaling in (("fp8", "delayed"), ("fp8", "current"), ("bf16", "delayed"))
         if tp == 1 or dtype == "fp8"]
CASES += [(f, 2, "fp8", scaling, "sp") for f in ("gpt", "llama") for scaling in ("delayed",
                                                                                 "current")]
"""With sequence parallelism a float8 linear keeps the float8 copy of its rank's chunk of
the gathered input and gathers it again in backward: the same bytes."""


@pytest.fixture(scope="module")
def runs() -> dict:
    """tp = 2 cases in one launch of two processes, tp = 1 cases in one launch of one
    (each case compiles and trains a Trainer of its own: nothing but the process group is
    shared, as between the tp = 2 cases)."""
    out = {}
    out.update(run_local(run_fp8_cases, 2, [c for c in CASES if c[1] == 2])[0])
    out.update(run_local(run_fp8_cases, 1, [c for c in CASES if c[1] == 1])[0])
    return out


@pytest.mark.parametrize("sp", [(), ("sp",)], ids=["tp2", "tp2+sp"])
@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_tp2_trains_as_tp1(runs, family, scaling, sp):
    one, two = runs[(family, 1, "fp8", scaling)], runs[(family, 2, "fp8", scaling, *sp)]
    assert any("fp8_linear" in line for line in two["log"])
    assert_trains_as_tp1(one, two)


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_fp8_stays_within_e4m3_precision_of_bf16(runs, family, scaling):
    fp8, bf16 = runs[(family, 1, "fp8", scaling)], runs[(family, 1, "bf16", "delayed")]
    assert not any("fp8_linear" in line for line in bf16["log"])
    for step, (a, b) in enumerate(zip(fp8["losses"], bf16["losses"]), 1):
        assert abs(a - b) <= 2**-3 * b, f"step {step}: fp8 {a} vs bf16 {b}"
    print(family, scaling, "fp8", fp8["losses"], "bf16", bf16["losses"])
