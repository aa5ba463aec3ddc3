"""Plan search, the fit solvers, the renderings, and the 70B layouts' ordering."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from ptc.compiler.estimate import estimate
from ptc.compiler.fit import largest_micro_batch, smallest_model_parallel
from ptc.compiler.report import render_explain, render_search
from ptc.compiler.search import search, search_all
from ptc.compiler.shapes import plan_from_shape

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SMALL = dict(family="gpt", layers=8, hidden=512, heads=8, vocab=1024, seq_len=512,
             global_batch=64, gpu="A100-40GB", num_gpus=16)


def test_search_ranks_fitting_layouts_by_step_time():
    plan = plan_from_shape(**SMALL, tp="auto", pp="auto", dp="auto")
    ranked = search(plan, top=4)
    times = [est.step_time_s for _, est in ranked]
    assert len(ranked) == 4 and times == sorted(times)
    assert all(est.fits for _, est in ranked)
    for found, est in ranked:  # the returned plans are the estimated layouts
        assert estimate(found).step_time_s == pytest.approx(est.step_time_s)


def test_search_keeps_fixed_axes_and_reports_misses():
    plan = plan_from_shape(**{**SMALL, "hidden": 4096, "heads": 32, "layers": 32},
                           tp=2, pp="auto", dp="auto")
    result = search_all(plan, top=3)
    assert all(p.parallel.tp == 2 for p, _ in result.ranked)
    assert result.rejected and all(r.over_bytes > 0 for r in result.rejected)
    assert result.candidates == result.fitting + len(result.rejected)


def test_fit_solvers():
    plan = plan_from_shape(**{**SMALL, "hidden": 4096, "heads": 32, "layers": 32},
                           tp=4, pp=1, dp=4, checkpoint="full")
    mb = largest_micro_batch(plan)
    assert mb is not None and mb >= 1
    tp, pp = smallest_model_parallel(plan)
    assert tp * pp <= 4


def test_renderings_mention_the_essentials():
    plan = plan_from_shape(**SMALL, tp=2, pp=2, dp=4)
    console = Console(width=240, record=True)
    console.print(render_explain(plan))
    text = console.export_text()
    for needle in ("step time", "MFU", "activations =", "Largest micro-batch"):
        assert needle in text
    console.print(render_search(plan_from_shape(**SMALL, tp="auto", pp="auto", dp="auto"), 3))
    assert "Fastest layouts" in console.export_text()


@pytest.fixture(scope="module")
def llama70b():
    from ptc.dsl import load_plan

    return {name: estimate(load_plan(EXAMPLES / f"llama70b_h100x64_{name}.ptc"))
            for name in ("dp64", "zero3_dp64", "tp8_pp4_dp2", "tp8_pp8_dp1")}


def test_llama70b_on_64_h100_ordering(llama70b):
    est = llama70b
    assert not est["dp64"].fits  # 16 bytes of model state per parameter, unsharded
    assert est["zero3_dp64"].fits and est["tp8_pp4_dp2"].fits and est["tp8_pp8_dp1"].fits
    assert est["tp8_pp4_dp2"].step_time_s < est["tp8_pp8_dp1"].step_time_s \
        < est["zero3_dp64"].step_time_s
