"""`ptc explain` renders the decisions of a compile, estimating once.

The estimate a compile makes (`resolve`, through `balanced_cut`) is the one
explain shows: nothing in the rendering or the memory check after it
estimates again (what they add, memory without recompute and what would fit,
is the memory model's). With `--plan-only` it estimates the plan without
compiling, once, and says so.
"""

from __future__ import annotations

import pytest

import ptc.compiler.search.estimate as estimate_module
from ptc.cli import main

pytestmark = pytest.mark.timeout(300)

PLAN = "examples/llama70b_h100x64_tp8_pp4_dp2.ptc"  # pp 4, v 2, checkpoint selective


@pytest.fixture
def estimates(monkeypatch) -> list[int]:
    """Counts the cost model's entry points: every estimate goes through `balanced_cut`, and
    a what-if priced layout by layout would go through `estimate_layout` outside it."""
    calls: list[str] = []
    cut, layout = estimate_module.balanced_cut, estimate_module.estimate_layout
    inside = []

    def counted_cut(*args, **kwargs):
        calls.append("balanced_cut")
        inside.append(True)
        try:
            return cut(*args, **kwargs)
        finally:
            inside.pop()

    def counted_layout(*args, **kwargs):
        if not inside:
            calls.append("estimate_layout")
        return layout(*args, **kwargs)

    monkeypatch.setattr(estimate_module, "balanced_cut", counted_cut)
    monkeypatch.setattr(estimate_module, "estimate_layout", counted_layout)
    return calls


@pytest.mark.parametrize("flags,says", [
    ((), "Predicted from the compile's decisions"),
    (("--plan-only",), "Predicted from the plan alone, not compiled"),
])
def test_explain_estimates_once(estimates, capsys, flags, says) -> None:
    assert main(["explain", PLAN, *flags]) == 0
    out = capsys.readouterr().out
    assert says in " ".join(out.split())
    assert estimates == ["balanced_cut"]


def test_the_compiled_explanation_is_the_programs(capsys) -> None:
    """The step time explain prints is the Program's prediction, at the cut it compiled."""
    from ptc.dsl import load_plan  # noqa: PLC0415
    from ptc.lower.driver import compile_plan  # noqa: PLC0415
    from ptc.units import format_seconds  # noqa: PLC0415

    program = compile_plan(load_plan(PLAN))
    assert main(["explain", PLAN]) == 0
    out = capsys.readouterr().out
    assert format_seconds(program.decisions.estimate.step_time_s) in out
