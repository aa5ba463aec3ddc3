"""`runtime.compile = true`: stage graphs run through torch.compile (inductor) train like eager.

Inductor fuses element-wise chains and reorders reductions, so a compiled
graph rounds differently from the eager one: equality is held to the same
bounds the eager layouts meet (`tests/tolerances.py`, derived from an fp64
rerun of the eager training), which such reorderings stay far inside (a
reordered fp32 sum moves by about n·eps of its magnitude, as tp's split sums
do). The cases put the collectives ptc inserts inside the compiled graphs:
tp 2 with sequence parallelism (copy/reduce and all-gather/reduce-scatter of
the sequence), and dp 2 with ZeRO-3 (the graph's own parameter gathers under
a session's saved-tensor hooks). One launch of 2 gloo processes trains both.
"""

from __future__ import annotations

import dataclasses

import pytest
from dist_helpers import STEPS, assert_same_training, reference
from tp_helpers import TPCase, tp_plan

from ptc.plan import Plan
from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed

CASES = [TPCase("gpt", 2, True), TPCase("llama", 1, dp=2, zero=3)]


def compiled_plan(case: TPCase) -> Plan:
    """The eager equivalence tests' plan of `case`, with its stage graphs compiled."""
    plan = tp_plan(case)
    return dataclasses.replace(plan, runtime=dataclasses.replace(plan.runtime, compile=True))


def run_compiled_cases(cases: list[TPCase]) -> dict:
    """Worker: train every case with runtime.compile (`dist_helpers.train_cases`); with each
    case's result, the number of graphs dynamo compiled so far (none: nothing was compiled)."""
    from dist_helpers import train_cases
    from torch._dynamo.utils import counters

    results = train_cases(cases, compiled_plan)
    for got in results.values():
        got["compiled_graphs"] = counters["stats"]["unique_graphs"]
    return results


_runs: dict = {}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_compiled_stage_graphs_train_like_eager(case: TPCase) -> None:
    if not _runs:
        _runs.update(run_local(run_compiled_cases, 2, CASES)[0])
    got = _runs[case]
    assert len(got["losses"]) == STEPS
    assert got["compiled_graphs"] > 0
    assert_same_training(got, reference(tp_plan(case)), what=f"compiled {case}")
