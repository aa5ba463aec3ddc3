"""Every table ptc prints is readable at 80 columns: cells whole, never cut to "optimi…"."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from ptc.views.inspect import render_graph
from ptc.views.explain import render_explain, render_search
from ptc.views.tables import FitTable, Prose, wrap
from ptc.dsl import load_plan
from ptc.lower.driver import compile_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _text(renderable, width: int) -> str:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(renderable)
    return out.getvalue()


def _table(rows: int, cols: int) -> FitTable:
    table = FitTable("numbers")
    table.add_column("stage", justify="right")
    for c in range(cols):
        table.add_column(f"term {c}", justify="right")
    for r in range(rows):
        table.add_row(str(r), *(f"{r}{c}.5 GiB" for c in range(cols)))
    return table


def test_a_table_that_fits_prints_as_a_table():
    text = _text(_table(3, 4), 80)
    assert "┃ stage ┃   term 0 ┃" in text and "│     2 │ 20.5 GiB │" in text


def test_a_wide_table_turns_and_then_stacks_keeping_every_cell_whole():
    wide = _table(3, 12)  # 12 number columns of 9 characters: more than 80
    turned = _text(wide, 80)
    assert "┃ stage   ┃" in turned and "│ term 11 │ 011.5 GiB │" in turned
    stacked = _text(_table(12, 12), 80)  # turned it would be as wide
    assert "┃" not in stacked
    assert "stage 11\n  term 0   110.5 GiB\n" in stacked
    for text in (turned, stacked):
        assert "…" not in text and all(len(line) <= 80 for line in text.splitlines())


def test_a_long_number_column_beside_text_that_wraps_keeps_the_table_within_the_width():
    """rich alone narrows the widest columns evenly and then widens a number column back to
    its cells: one column too wide. FitTable sizes the columns itself."""
    table = FitTable("rates")
    for name in ("figure", "value", "from"):
        table.add_column(name, justify="right" if name == "value" else "left")
    for _ in range(3):
        table.add_row("dispatch per op (hidden behind longer kernels)",
                      "95.1% forward, 97.0% backward", "preset H100-SXM")
    lines = _text(table, 80).splitlines()
    assert max(map(len, lines)) == 80 and "│ 95.1% forward, 97.0% backward │" in lines[4]


def test_prose_wraps_between_words_and_keeps_numbers_with_their_units():
    lines = _text(Prose("the bucket holds 2.1 MiB; " * 6, indent=4), 40).splitlines()
    assert len(lines) > 1 and all(len(line) <= 40 for line in lines)
    assert lines[1].startswith("    ") and not any(line.endswith(" 2.1") for line in lines)
    path = "a/very/long/path/" * 6  # wider than the width: whole on a line of its own
    assert wrap(f"see {path} there", 40) == ["see", f"  {path}", "  there"]


@pytest.mark.parametrize("render", ["explain", "plan", "inspect"])
def test_ptcs_views_cut_nothing_at_80_columns(render):
    plan = load_plan(EXAMPLES / ("tiny_gpt_cpu.ptc" if render == "inspect"
                                 else "llama70b_h100x64_tp8_pp4_dp2.ptc"))
    if render == "inspect":
        text = render_graph(compile_plan(plan), 0, "table", width=80)
        assert "placeholder" in text and "layers.0.attn.qkv" in text
    else:
        view = render_explain(plan) if render == "explain" else render_search(plan, top=3)
        text = _text(view, 80)
        assert ("optimizer" in text and "activations" in text) if render == "explain" \
            else "tokens/s" in text
    assert "…" not in text


def test_explain_shows_a_power_limit_beside_the_gemm_rate_it_lowers():
    plan = load_plan(EXAMPLES / "llama70b_h100x64_tp8_pp4_dp2.ptc",
                     overrides={"hardware.power_limit": "500 W"})
    share = (500 / 700) ** (1 / 3)  # docs/cost-model.md, "Power limits"
    text = " ".join(_text(render_explain(plan), 80).split())
    assert f"x {plan.hardware.achievable_fraction:g} x {share:.3g})" in text
    assert "│ power limit (GEMM" in text and f"clock x {share:.3g})" in text
    assert "│ 500 W of 700 W │ plan" in text
    full = " ".join(_text(render_explain(load_plan(
        EXAMPLES / "llama70b_h100x64_tp8_pp4_dp2.ptc")), 80).split())
    assert "power limit" not in full


def test_explain_shows_an_attention_kernel_rate_the_plan_names():
    plan = load_plan(EXAMPLES / "llama70b_h100x64_tp8_pp4_dp2.ptc",
                     overrides={"hardware.attention_fraction": "0.3"})
    rate = plan.hardware.attention_rate("bf16") / 1e12
    text = " ".join(_text(render_explain(plan), 100).split())
    assert "fused attention kernel (bf16)" in text and f"{rate:,.4g} TFLOP/s (peak x 0.3)" in text
    full = " ".join(_text(render_explain(load_plan(
        EXAMPLES / "llama70b_h100x64_tp8_pp4_dp2.ptc")), 100).split())
    assert "fused attention kernel" not in full
