"""`parallel.ep` in plan text: it parses into ParallelSpec.ep, dumps back, and its errors are
located at the key (the value's own check, and the cross-section ones of `ptc.checks`)."""

from __future__ import annotations

import pytest
from dsl_helpers import BASE, edit, errors, find

from ptc.dsl import dump_plan, parse

# BASE's parallel section: tp = 2 at line 19, pp 20, dp 21, zero = 1 at line 22; a key
# inserted after zero lands on line 23, its value at column 8 (`  ep = ...`).
WITH_EP = "zero = 1\n  ep = {}"


def test_ep_parses_into_the_parallel_spec_and_dumps_back() -> None:
    plan = parse(edit("zero = 1", WITH_EP.format(2)), "plan.ptc")
    assert plan.parallel.ep == 2
    assert plan.expert_grad_ranks == 1  # dp(2) * cp(1) / ep(2)
    text = dump_plan(plan)
    assert "ep = 2" in text
    assert parse(text) == plan


def test_ep_defaults_to_one() -> None:
    plan = parse(BASE)
    assert plan.parallel.ep == 1
    assert plan.expert_grad_ranks == plan.grad_ranks == 2


def test_ep_auto_is_left_to_plan_search() -> None:
    plan = parse(edit("zero = 1", WITH_EP.format("auto")), "plan.ptc")
    assert plan.parallel.ep == "auto"
    assert not plan.is_resolved  # `ptc plan` picks it
    assert parse(dump_plan(plan)) == plan


@pytest.mark.parametrize("value, needle, width", [
    ("0", "ep must be >= 1, got 0", 1),
    ("1.5", "ep must be an integer or auto, got 1.5", 3),
], ids=["zero", "fraction"])
def test_a_bad_ep_value_is_located_at_the_value(value: str, needle: str, width: int) -> None:
    text = edit("zero = 1", WITH_EP.format(value))
    d = find(errors(text), needle)
    assert d.field == "parallel.ep"
    assert (d.span.line, d.span.column) == (23, 8), d.render()
    assert d.span.source_line == f"  ep = {value}"
    assert d.render().startswith("plan.ptc:23:8: error: ")
    assert "\n    " + " " * 7 + "^" * width in d.render()


def test_ep_that_does_not_divide_dp_cp_is_located_with_the_divisors() -> None:
    d = find(errors(edit("zero = 1", WITH_EP.format(4))),
             "ep(4) must divide dp(2) * cp(1) = 2")
    assert d.field == "parallel.ep"
    assert (d.span.line, d.span.column) == (23, 8)
    assert set(d.choices) == {"1", "2"}


def test_ep_with_offload_points_at_offload() -> None:
    text = edit("zero = 1", WITH_EP.format(2) + "\n  offload = optimizer")
    d = find(errors(text), "ep(2) with offload = optimizer is not supported")
    assert d.field == "parallel.offload"
    assert (d.span.line, d.span.column) == (24, 13), d.render()
    assert "none" in d.choices


def test_ep_with_zero_3_is_a_valid_plan() -> None:
    plan = parse(edit("zero = 1", "ep = 2\n  zero = 3"))
    assert (plan.parallel.ep, plan.parallel.zero) == (2, 3)


def test_moe_imbalance_parses_dumps_back_and_is_what_the_cost_model_prices() -> None:
    """`moe { imbalance }`: the plan's own figure wins; unset, an even routing (1) unless
    the hardware profile measured one (tests/distributed/test_calibrate.py)."""
    plan = parse(BASE + "moe {\n  imbalance = 1.25\n}\n", "plan.ptc")
    assert (plan.moe.imbalance, plan.routing_imbalance) == (1.25, 1.25)
    assert "imbalance = 1.25" in dump_plan(plan) and parse(dump_plan(plan)) == plan
    assert parse(BASE).routing_imbalance == 1.0


def test_an_imbalance_below_one_is_located_at_the_value() -> None:
    text = BASE + "moe {\n  imbalance = 0.8\n}\n"
    d = find(errors(text), "imbalance must be >= 1, got 0.8")
    assert d.field == "moe.imbalance"
    assert d.span.source_line == "  imbalance = 0.8"
