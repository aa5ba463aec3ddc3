"""`train.dtype = fp8` (emulated) trains under pipeline parallelism as without it.

The 4-layer tiny GPT and Llama, 4 micro-batches of one sample, 5 AdamW steps
in fp8 with `fp8_emulate = true`, delayed and current scaling: pp = 2 under
1F1B (and Llama under interleaved 1F1B with 2 chunks per rank; GPT and Llama under the
zero-bubble schedule, whose split backward runs each float8 linear's backward in its I
and again in its W, recording the same amaxes twice into the step's running max) against
pp = 1 with the same fp8 plan.

What pp changes: each stage holds the float8 states of its own linears, and
a linear sees the same micro-batches in the same order as without pp, so
its amaxes, its delayed-scaling history and every float8 value it rounds to
are the same; the first step's forward is the same computation, so its loss
is equal exactly. What differs is the order of a few fp32 sums: the global
gradient norm adds the two stages' partial sums (one rounding in the clip
factor), and GPT's tied embedding adds the head's gradient from the other
stage. Those move the weights by rounding, and the next steps' losses by
what that does to bf16 numbers near 4 (one ulp = 2^-5): the bound is the one
tp = 2 has against tp = 1 (`test_fp8_training.py`), losses within 2 ulps
(2^-6 relative) and every parameter within 2·lr·steps of the other (Adam
moves an element by at most about lr a step, whatever its gradient).
Measured: the losses equal at every step; parameters at most 6e-8 apart for
Llama (the clip factor's last bit), 4.3e-3 for GPT (the tied embedding).
"""

from __future__ import annotations

import pytest
import torch
from fp8_helpers import run_fp8_pp_cases

from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed

LR, STEPS = 3e-3, 5
PIPELINED = [(f, 2, "1f1b", s, 1) for f in ("gpt", "llama") for s in ("delayed", "current")] \
    + [("llama", 2, "interleaved", "delayed", 2), ("gpt", 2, "zero_bubble", "delayed", 1),
       ("llama", 2, "zero_bubble", "current", 1)]


def unpipelined(case: tuple) -> tuple:
    family, _, _, scaling, _ = case
    return family, 1, "1f1b", scaling, 1


@pytest.fixture(scope="module")
def runs() -> dict:
    """pp = 2 cases in one launch of two processes, the pp = 1 ones in one process."""
    out = run_local(run_fp8_pp_cases, 2, PIPELINED)[0]
    out.update(run_local(run_fp8_pp_cases, 1, sorted({unpipelined(c) for c in PIPELINED}))[0])
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", PIPELINED, ids=lambda c: f"{c[0]} {c[2]} {c[3]}")
def test_pp2_trains_as_pp1_in_fp8(runs, case) -> None:
    two, one = runs[case], runs[unpipelined(case)]
    assert any("fp8_linear" in line for line in two["log"])
    assert two["losses"][0] == one["losses"][0]
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]),
                               rtol=2**-6, atol=0)
    bound = 2 * LR * STEPS
    assert two["state"].keys() == one["state"].keys()
    for name, value in one["state"].items():
        diff = (two["state"][name].float() - value.float()).abs()
        assert diff.max() <= bound, f"{name}: {diff.max():.3g} > {bound:.3g}"
