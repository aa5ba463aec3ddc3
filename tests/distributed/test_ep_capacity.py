"""Token dropping at a capacity per expert (`moe { capacity_factor }`) is the same under every layout.

With a capacity each expert computes at most ceil(f · N / E) of the N rows a
rank routes to its layer, decided on the rank's own rows before any
exchange (`ptc.ops.expert_capacity`, Megatron-LM's
--moe-expert-capacity-factor). What is dropped then depends on the rank's
tokens and the router alone, not on where the experts live: a run whose
experts are spread over ep ranks trains as the one holding them all (ep 1),
step for step and parameter for parameter, and drops the same rows on every
rank. Dropping by routing weight ("probs") is discontinuous: once two
layouts' weights differ by rounding (after the first update), a row at an
expert's capacity edge may go in one and stay in the other, so under "probs"
the first step is compared (its routing, on the same weights and tokens, is
the same computation in both) and under "position" (kept by the router's
choice alone, as dropless routing) every step. Bounds: two fp32 runs of the same computation each end within
`Reference.param_bound` (and the loss within `loss_bounds`) of the exact one,
derived from the eager module's own fp32 and fp64 runs; so within twice that
of each other. A capacity no expert can exceed (f = E: C = N) drops nothing,
and then the run equals eager training of the module (dropless), as ptc
without a capacity does. All cases in one launch of 4 gloo processes.
"""

from __future__ import annotations

import pytest
from dist_helpers import assert_same_training, reference
from hf_helpers import HFCase, hf_module, hf_plan, record_ep_step, run_hf_cases

from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed

PAIRS = [  # (experts spread, experts on every rank): the same drops
    (HFCase("mixtral", dp=4, ep=4, capacity=0.5, drop_policy="position"),
     HFCase("mixtral", dp=4, capacity=0.5, drop_policy="position")),
    (HFCase("qwen3_moe", dp=4, ep=2, zero=1, capacity=0.75, drop_policy="position"),
     HFCase("qwen3_moe", dp=4, zero=1, capacity=0.75, drop_policy="position")),
    (HFCase("mixtral", dp=4, ep=2, capacity=1.0), HFCase("mixtral", dp=4, capacity=1.0)),
    (HFCase("qwen3_moe", dp=4, ep=2, zero=1, capacity=0.75),
     HFCase("qwen3_moe", dp=4, zero=1, capacity=0.75)),
]
DROPLESS = [HFCase("mixtral", dp=4, ep=2, capacity=4.0)]  # 4 experts: C = N
_runs: dict = {}


def _results() -> dict:
    if not _runs:
        cases = [c for pair in PAIRS for c in pair] + DROPLESS
        _runs.update(run_local(run_hf_cases, 4, cases)[0])
        _runs["steps"] = run_local(record_ep_step, 4, [c for pair in PAIRS for c in pair])[0]
    return _runs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("spread,whole", PAIRS, ids=[str(a) for a, _ in PAIRS])
def test_spread_experts_drop_and_train_as_whole_ones(spread: HFCase, whole: HFCase) -> None:
    got = _results()
    ref = reference(hf_plan(whole), hf_module(whole))  # the bounds' scale (see docstring)
    a, b = got[spread], got[whole]
    bounds = ref.loss_bounds()
    steps = len(bounds) if spread.drop_policy == "position" else 1
    for step, (x, y) in enumerate(zip(a["losses"][:steps], b["losses"][:steps])):
        assert abs(x - y) <= 2 * bounds[step], f"{spread}: loss of step {step} {x} vs {y}"
    for name, value in b["state"].items() if steps > 1 else ():
        diff = (a["state"][name].double() - value.double()).abs()
        assert bool((diff <= 2 * ref.param_bound(name)).all()), f"{spread}: {name} differs"
    dropped = got["steps"][spread]["dropped"]
    assert dropped == got["steps"][whole]["dropped"], spread
    assert sum(dropped) > 0, f"{spread}: the capacity dropped nothing, the test shows nothing"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", DROPLESS, ids=str)
def test_a_capacity_no_expert_can_exceed_trains_like_eager(case: HFCase) -> None:
    assert_same_training(_results()[case], reference(hf_plan(case), hf_module(case)), str(case))
