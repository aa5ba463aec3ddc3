"""ZeRO 0/1/2/3 on 2, 3 and 4 gloo processes train exactly like plain single-process PyTorch.

For tiny GPT (tied embeddings) and tiny Llama (GQA, RoPE), with and without
gradient accumulation: the loss of every step and every parameter after 5
AdamW steps (cosine schedule with warm-up, global-norm clipping at 1.0)
equal `torch.optim.AdamW` on the eager model over the full global batch,
from the same initial weights on the same samples.

Tolerances (fp32): derived per case by `tests/tolerances.py` from the same
eager training in float64 — the fp32 reference's own rounding, the compared
magnitudes and, per element, Adam's amplification of gradient rounding.

Each process count launches once and trains all 17 cases in a row
(module-scoped cache), so start-up is paid three times in all (3 processes:
every unit padded to a multiple of dp, the odd case).
The bytes each rank holds afterwards are checked against the Program's
prediction, the ZeRO formulas and the compiler's memory model. Steps run as
the training loop runs them: at ZeRO 1-2 each leaves its weight all-gathers
in flight, waited for unit by unit by the next forward's `await_weights`
nodes, so equality covers that path too.
"""

from __future__ import annotations

import pytest
from dist_helpers import STEPS, assert_same_training, reference, run_cases, tiny_plan
from tests.tolerances import Reference

from ptc.compiler.search.estimate import estimate
from ptc.compiler.memory.model import stage_params
from ptc.lower.driver import compile_plan
from ptc.compiler.profile.cache import model_profile
from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed

FAMILIES = ("gpt", "llama")
ZERO = (0, 1, 2, 3)
ACCUM = (1, 2)
CASES = [(f, z, a) for f in FAMILIES for z in ZERO for a in ACCUM]
NO_OVERLAP = ("llama", 3, 2, False)
"""ZeRO-3 without prefetch (gathers on demand), run in every launch."""

_runs: dict[int, dict] = {}


def _run(dp: int) -> dict:
    """Every case of `dp` processes, both families, from one launch."""
    if dp not in _runs:
        _runs[dp] = run_local(run_cases, dp, [*CASES, NO_OVERLAP], dp)[0]
    return _runs[dp]


def _reference(dp: int, family: str, accum: int) -> Reference:
    return reference(tiny_plan(family, zero=0, dp=dp, accum=accum))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dp", [2, 3, 4])
@pytest.mark.parametrize("family,zero,accum", CASES)
def test_matches_single_process_adamw(dp: int, family: str, zero: int, accum: int) -> None:
    got = _run(dp)[(family, zero, accum)]
    assert len(got["losses"]) == STEPS
    # ZeRO 1-2: every unit's weight all-gather is left in flight after each step but the last,
    # for the next forward to wait on where it first reads the unit; none otherwise.
    units = len(compile_plan(tiny_plan(family, zero=zero, dp=dp, accum=accum)).layout.units)
    left = units if zero in (1, 2) else 0
    assert got["left_in_flight"] == [left] * (STEPS - 1) + [0]
    assert_same_training(got, _reference(dp, family, accum),
                         what=f"{family} zero={zero} dp={dp} accum={accum}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dp", [2, 3, 4])
def test_zero3_without_prefetch_matches_too(dp: int) -> None:
    family, zero, accum, _ = NO_OVERLAP
    got = _run(dp)[NO_OVERLAP]
    assert got["log"][0] == "shard_params_pass: inserted 5 gather_params"
    assert got["log"][1].endswith("gathers start 0 ahead"), got["log"]
    assert_same_training(got, _reference(dp, family, accum),
                         what=f"{family} zero=3 dp={dp} accum={accum} without prefetch")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dp", [2, 3, 4])
@pytest.mark.parametrize("family,zero", [(f, z) for f in FAMILIES for z in ZERO])
def test_held_bytes_match_prediction_and_zero_formulas(dp: int, family: str, zero: int) -> None:
    got = _run(dp)[(family, zero, 1)]
    held, predicted = got["held"], got["predicted"]
    assert held == predicted
    layout = compile_plan(tiny_plan(family, zero=zero, dp=dp, accum=1)).layout
    # Each unit is padded to a multiple of dp (none at dp 2 and 4, a few elements at dp 3).
    P = sum(unit.padded_numel for unit in layout.units)
    assert P % dp == 0 and P - layout.numel < dp * len(layout.units)
    assert held["params"] == (4 * P // dp if zero == 3 else 4 * P)
    assert held["grads"] == (4 * P // dp if zero >= 2 else 4 * P)
    assert held["optimizer"] == (8 * P // dp if zero >= 1 else 8 * P)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family,zero", [(f, z) for f in FAMILIES for z in ZERO])
def test_held_bytes_match_memory_model(family: str, zero: int) -> None:
    """weights and grads equal the memory model's; optimizer equals it without step counters.

    The memory model counts torch's 4-byte step counter per parameter tensor;
    the runtime's AdamW runs on one flat buffer per unit, with one counter per
    unit, and `held_bytes` leaves 0-dim counters out.
    """
    dp = 2
    held = _run(dp)[(family, zero, 1)]["held"]
    plan = tiny_plan(family, zero=zero, dp=dp, accum=1)
    est = estimate(plan)
    terms = est.memory_terms[0]
    tensors = stage_params(model_profile(plan.model, plan.train.dtype), est.layout, 0)[2]
    counters = 4 * tensors / (dp if zero >= 1 else 1)
    assert held["params"] == terms["weights"]
    assert held["grads"] == terms["grads"]
    assert held["optimizer"] == pytest.approx(terms["optimizer"] - counters)
