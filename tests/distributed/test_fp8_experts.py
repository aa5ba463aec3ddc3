"""Routed experts' grouped products in float8 (`train.dtype = fp8`, emulated) under expert
parallelism, tensor parallelism, ZeRO-3 and recompute.

One grouped product (`ptc.ops.fp8_grouped`), op by op, on 2 gloo processes:
- ep 2: each rank's rows (4 experts, uneven, one expert receiving none) through
  ep_dispatch, the rank's 2 experts with their local offsets, and ep_combine, against
  the same product of every rank's rows on one process. tensorwise runs delayed with
  both states loaded with one history, so that both take the same scales, and each ep
  rank must record its own experts' weight amaxes in their rows of the history;
  rowwise and mxfp8 scale each row, and each expert's rows, by themselves, which ep does
  not change. The same float8 values multiply: y, dx and the rank's experts' dW agree
  within the fp32 bound of summing the same products in another order (measured: equal).
- tp 2: the stack split column-parallel (output features) and row-parallel (input
  features), every recipe (tensorwise's amaxes, per expert a vector, reduced over tp;
  rowwise's scale vectors along a split contraction; mxfp8's blocks within a shard),
  against the whole product: `test_fp8_recipes`' bound for a linear.

Training: the tiny Mixtral (2 layers, 4 experts, top-2) trains 5 AdamW steps at dp 2 ×
ep 2 in fp8, tensorwise (delayed) and rowwise (current), against its own fp8 reference:
the same plan without expert parallelism. Both quantise the linears alike; their expert
products round the same operands with other scales (tensorwise: a rank's received rows
share x's and dy's scale, not its own tokens' rows; rowwise: the weight gradient's
columns span an expert's rows from both ranks), a rounding of the same size. With e the
same plan in bf16, unquantised, |q - r| <= |q - e| + |r - e| and q's distance from e is
of the kind of r's, measured: so K = 4 times it (2 for the triangle, 2 for the spread
between two runs' errors, as `tests/tolerances.py` argues for fp32 against fp64), the
loss of each step floored at K ulps of bf16 (ptc's losses are no finer), and each
parameter's median distance from e at most K times r's; every parameter within 2·lr·steps
of r's (Adam moves an element by at most about lr a step). ZeRO-3 with full recompute,
and op-level recompute (a saving region keeps the grouped products' outputs), under
dp 2 × ep 2 quantise as plain dp 2 × ep 2: `assert_trains_as_tp1`'s bound. Each rank
holds what the Program says.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fp8_expert_helpers import MIXTRAL, ep_grouped_worker, run_fp8_moe_cases
from fp8_helpers import LR, STEPS, assert_trains_as_tp1, split_gemm_worker

from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed

RECIPES = ("tensorwise", "rowwise", "mxfp8")
K = 4.0
"""Times the reference's own distance from the unquantised run (module docstring)."""
EP2 = dataclasses.replace(MIXTRAL, ep=2)
TRAINED = {"tensorwise": ("fp8",), "rowwise": ("fp8", "rowwise", "current")}
CASES = [(case, *fp8) for fp8 in TRAINED.values() for case in (EP2, MIXTRAL)]
CASES += [(MIXTRAL, "bf16")]
RECOMPUTED = [(dataclasses.replace(EP2, zero=3, checkpoint="full"), "fp8"),
              (dataclasses.replace(EP2, checkpoint="ops"), "fp8")]
CASES += RECOMPUTED


@pytest.fixture(scope="module")
def ep_products() -> dict:
    return run_local(ep_grouped_worker, 2, RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_an_ep_rank_multiplies_its_experts_as_the_whole_product(ep_products, recipe):
    for rank, got in ep_products.items():
        assert max(got[recipe].values()) <= 1, (rank, got[recipe])


def test_an_ep_rank_records_its_own_experts_amaxes(ep_products):
    for rank, got in ep_products.items():
        recorded, want = got["pending"]
        torch.testing.assert_close(torch.tensor(recorded), torch.tensor(want), rtol=0, atol=0,
                                   msg=lambda m, rank=rank: f"rank {rank}: {m}")


@pytest.fixture(scope="module")
def tp_products() -> dict:
    return run_local(split_gemm_worker, 2, RECIPES, grouped=True)[0]


@pytest.mark.parametrize("role", ["column", "row"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_tp_split_experts_quantise_as_the_whole_stack(tp_products, recipe, role):
    assert max(tp_products[recipe, role].values()) <= 1, tp_products[recipe, role]


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_local(run_fp8_moe_cases, 2, CASES)[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("recipe", TRAINED)
def test_dp2_ep2_trains_as_its_fp8_reference(runs, recipe):
    fp8 = TRAINED[recipe]
    got, ref, exact = runs[(EP2, *fp8)], runs[(MIXTRAL, *fp8)], runs[(MIXTRAL, "bf16")]
    for inserted in ("4 fp8_grouped_mm", "2 ep_dispatch"):
        assert any(inserted in line for line in got["log"]), got["log"]
    assert got["held"] == got["predicted"]
    eps = torch.finfo(torch.bfloat16).eps
    for step, (q, r, e) in enumerate(zip(got["losses"], ref["losses"], exact["losses"]), 1):
        bound = K * max(abs(r - e), eps * abs(e))
        assert abs(q - r) <= bound, f"step {step}: ep {q}, reference {r}, bf16 {e}: {bound:.3g}"
    for name, value in ref["state"].items():
        mine, theirs = (_median_distance(s["state"][name], exact["state"][name])
                        for s in (got, ref))
        assert mine <= K * theirs, f"{name}: median distance from bf16 {mine:.3g}, " \
                                   f"the reference's {theirs:.3g}"
        diff = (got["state"][name].float() - value.float()).abs().max()
        assert diff <= 2 * LR * STEPS, f"{name}: {diff:.3g}"


def _median_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().flatten().median().item()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", RECOMPUTED, ids=lambda case: str(case[0]))
def test_zero3_and_recompute_quantise_as_plain_ep(runs, case):
    assert runs[case]["held"] == runs[case]["predicted"]
    assert_trains_as_tp1(runs[(EP2, "fp8")], runs[case])
