"""Plan search, the fit solvers, the renderings, and the 70B layouts' ordering."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from rich.console import Console

from ptc.compiler.cost.step import step_cost
from ptc.compiler.search.estimate import auto_checkpoint, estimate, plan_precision
from ptc.compiler.search.fit import largest_micro_batch, smallest_model_parallel
from ptc.views.explain import render_explain, render_search
from ptc.compiler.memory.model import peak, stage_memory_terms
from ptc.compiler.profile.cache import plan_profile, with_model_shape
from ptc.compiler.search.plan_search import enumerate_layouts, search, search_all
from ptc.compiler.shapes import plan_from_shape
from ptc.plan import HardwareSpec

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


MiB = 2**20
TIGHT = dict(family="gpt", layers=8, hidden=512, heads=8, vocab=1024, seq_len=4096,
             global_batch=8, num_gpus=8, tp=1, pp="auto", dp="auto")
"""A GPT whose written-out attention dominates its memory: at a few GiB a GPU, whether its
layers fit without recompute depends on the layout, with one sequence per rank or fewer."""


def tight_plan(budget_mib: int):
    """TIGHT on GPUs of `budget_mib` MiB."""
    hw = dataclasses.replace(HardwareSpec.preset("A100-40GB"), hbm_bytes=budget_mib * MiB)
    return with_model_shape(plan_from_shape(**TIGHT, gpu=hw))


def every_fitting_step_time(plan, *, mixes: bool) -> list[float]:
    """Step times of every layout of `plan` that fits, by brute force: each uniform policy
    and (with `mixes`) each layout's least-recompute per-layer mix, every stage checked."""
    profile = plan_profile(plan)
    prec, seq, budget = plan_precision(plan, profile), plan.train.seq_len, plan.hardware.memory_budget

    def worst(lay):
        return max(peak(stage_memory_terms(profile, lay, i, prec, bb=lay.micro_batch,
                                           ss=lay.rank_seq(seq), tt=lay.tp, dd=lay.grad_ranks))
                   for i in range(lay.pp))

    fitting = [lay for lay in enumerate_layouts(plan) if worst(lay) <= budget]
    if mixes:
        mixed = [auto_checkpoint(profile, lay, prec, seq, budget)
                 for lay in enumerate_layouts(plan) if lay.checkpoint == "none"]
        fitting += [lay for lay in mixed if len(set(lay.checkpoint)) > 1 and worst(lay) <= budget]
    return sorted(step_cost(profile, lay, plan.hardware, prec, seq_len=seq,
                            dtype=plan.train.dtype).step_time for lay in fitting)


@pytest.mark.parametrize("budget_mib", [4000, 3000, 2000])
def test_search_ranks_per_layer_mixes_and_its_bound_prunes_none_that_would_win(budget_mib):
    """The search's top five are the brute force's, per-layer mixes included: the lower
    bound it ranks a mix by before choosing it never skips a faster one."""
    plan = tight_plan(budget_mib)
    result = search_all(plan, top=5)
    found = [est.step_time_s for _, est in result.ranked]
    assert found == pytest.approx(every_fitting_step_time(plan, mixes=True)[:5], rel=1e-12)
    assert result.candidates == result.fitting + len(result.rejected)


def test_a_mix_beats_every_uniform_policy_and_is_written_back_as_auto():
    plan = tight_plan(3000)
    (best_plan, best), *_ = search(plan, top=1)
    policies = best.layout.checkpoint
    assert not isinstance(policies, str) and set(policies) >= {"none"} and len(set(policies)) > 1
    uniform = every_fitting_step_time(plan, mixes=False)[0]
    assert best.step_time_s < uniform and best.fits
    # Written back as checkpoint = auto, the plan chooses the same mix again.
    assert best_plan.parallel.checkpoint == "auto"
    again = estimate(best_plan)
    assert again.layout.checkpoint == policies
    assert again.step_time_s == pytest.approx(best.step_time_s)


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


def test_zbv_is_searched_where_a_split_backward_runs_on_two_chunks():
    """ZB-V is enumerated beside 1F1B-interleaved and zero bubble exactly where it can
    run: pp >= 2, two chunks per rank, uncompiled graphs (`ptc.checks`); DualPipeV too
    where there are at least 2p micro-batches."""
    layouts = enumerate_layouts(plan_from_shape(**SMALL, tp="auto", pp="auto", dp="auto"))
    zbv = [lay for lay in layouts if lay.schedule == "zbv"]
    assert zbv and all(lay.pp >= 2 and lay.vstages == 2 for lay in zbv)
    assert any(lay.zero == 3 for lay in zbv)
    twins = {dataclasses.replace(lay, schedule="interleaved") for lay in zbv}
    assert twins <= set(layouts)  # each beside its interleaved 1F1B twin
    assert {dataclasses.replace(lay, schedule="zbv") for lay in layouts
            if lay.schedule == "interleaved" and lay.vstages == 2} == set(zbv)
    assert {dataclasses.replace(lay, schedule="dualpipev") for lay in zbv
            if lay.microbatches >= 2 * lay.pp} == {lay for lay in layouts
                                                    if lay.schedule == "dualpipev"}


def test_zbv_prices_zb_h1s_bubble_on_two_chunks():
    """ZB-V's bubble is ZB-H1's on two chunks, (p - 1)/2 · (F + I - W): with F = I = W its
    simulated step leaves p - 1 half-stage units (`tests/compiler/test_schedule.py`)."""
    def bubble(schedule: str, v: int) -> float:
        return estimate(plan_from_shape(**{**SMALL, "num_gpus": 4}, tp=1, pp=4, dp=1,
                                        micro_batch=8, schedule=schedule, virtual_stages=v)
                        ).breakdown["bubble"]
    assert bubble("zbv", 2) == pytest.approx(bubble("zero_bubble", 2))
    assert bubble("zbv", 2) == pytest.approx(bubble("zero_bubble", 1) / 2)
    assert bubble("zero_bubble", 1) < bubble("1f1b", 1)
