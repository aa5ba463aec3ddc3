"""The checkpoint interval and goodput model (`ptc.compiler.cost.goodput`).

Checked against what the formulas must do, not against their own output: the job
MTBF the per-GPU rate gives back at Llama 3's scale is Llama 3's (466 interruptions in
54 days on 16,384 GPUs: 2.78 h); Young's sqrt(2δM) is Daly's first term, so the two
agree as δ/M goes to 0; Daly's interval, derived from the exact expected run time, is
within a hair of the best interval of ptc's first-order goodput; and `ptc explain`
says what a plan's failures cost.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ptc.compiler.cost.goodput import (LLAMA3_GPUS, checkpoint_interval, goodput, job_mtbf,
                                       save_pause, snapshot_bytes, snapshot_goodput,
                                       snapshot_pause)
from ptc.compiler.profile.cache import plan_profile
from ptc.compiler.search.estimate import estimate, plan_precision
from ptc.dsl import load_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_per_gpu_rate_gives_llama3s_job_mtbf_back_and_scales_with_the_gpus():
    assert job_mtbf(LLAMA3_GPUS) / 3600 == pytest.approx(54 * 24 / 466)
    assert job_mtbf(8) == pytest.approx(job_mtbf(LLAMA3_GPUS) * LLAMA3_GPUS / 8)
    assert job_mtbf(8, 3 * 3600.0) == 3 * 3600.0  # the plan's own figure wins


@pytest.mark.parametrize("pause, mtbf", [(1.0, 1e6), (10.0, 1e4), (60.0, 3600.0)])
def test_daly_starts_from_young_and_sits_at_the_best_interval(pause, mtbf):
    young = math.sqrt(2 * pause * mtbf)
    daly = checkpoint_interval(pause, mtbf)
    assert abs(daly / young - 1) <= 2 * math.sqrt(pause / (2 * mtbf))
    grid = [young * k / 100 for k in range(10, 400)]
    best = max(goodput(t, pause, mtbf) for t in grid)
    assert goodput(daly, pause, mtbf) == pytest.approx(best, abs=1e-3)
    assert goodput(daly, pause, mtbf) > goodput(young / 4, pause, mtbf)
    assert goodput(daly, pause, mtbf) > goodput(young * 4, pause, mtbf)


def test_a_pause_as_long_as_the_mtbf_saves_once_per_failure():
    assert checkpoint_interval(5000.0, 1000.0) == 1000.0
    assert checkpoint_interval(0.0, 1000.0) == 0.0


def test_the_save_pause_is_the_ranks_share_of_masters_and_moments_over_the_host_link():
    plan = load_plan(EXAMPLES / "llama7b_h100x8.ptc")  # tp 2, dp 4, ZeRO-1, bf16, AdamW
    est = estimate(plan)
    profile = plan_profile(plan)
    pause = save_pause(profile, est.layout, plan.hardware, plan_precision(plan, profile))
    # 6.74e9 parameters (Llama-2-7B), 12 bytes each (fp32 master, two fp32 moments), split
    # over tp 2 and dp 4, over a PCIe 4 x16 link: about 0.16 s.
    assert pause == pytest.approx(6.74e9 * 12 / 8 / plan.hardware.host_bandwidth, rel=0.02)


def test_explain_says_what_failures_cost():
    from ptc.views.explain import render_explain
    from rich.console import Console

    console = Console(width=80, record=True)
    console.print(render_explain(load_plan(EXAMPLES / "llama7b_h100x8.ptc")))
    text = " ".join(console.export_text().split())
    assert "Failures: a save pauses training" in text
    assert "Young/Daly: a save every" in text and "at the plan's save every 30 min" in text


def test_a_snapshot_holds_the_ranks_weights_and_optimizer_and_pauses_three_passes():
    plan = load_plan(EXAMPLES / "llama7b_h100x8.ptc")  # tp 2, dp 4, ZeRO-1, bf16, AdamW
    est = estimate(plan)
    profile = plan_profile(plan)
    state = snapshot_bytes(profile, est.layout, plan_precision(plan, profile), plan.train.seq_len)
    # 6.74e9 parameters over tp 2: bf16 weights whole on each dp rank (2 bytes), the fp32
    # master and two moments (12 bytes) split over dp 4.
    assert state == pytest.approx(6.74e9 / 2 * (2 + 12 / 4), rel=0.02)
    assert snapshot_pause(state, plan.hardware) == pytest.approx(
        3 * state / plan.hardware.host_bandwidth)


def test_snapshots_every_step_lose_half_a_step_per_failure_and_pay_their_pause():
    step, sigma, mtbf = 2.0, 0.1, 3600.0
    # no storage saves to speak of (a pause of 0): the snapshots' share and half a step lost
    assert snapshot_goodput(1e9, 0.0, sigma, step, mtbf, restart_s=0.0) == pytest.approx(
        step / (step + sigma) * (1 - (step + sigma) / 2 / mtbf))
    # at Llama 3's 16K GPUs (M = 2.8 h) they beat storage alone with a 1-minute pause...
    mtbf, pause = job_mtbf(LLAMA3_GPUS), 60.0
    tau = checkpoint_interval(pause, mtbf)
    assert snapshot_goodput(tau, pause, sigma, step, mtbf) > goodput(tau, pause, mtbf)
    # every 10 steps: a tenth of the pauses, and each failure loses ten times the work
    ten = snapshot_goodput(tau, pause, sigma, step, mtbf, every=10, restart_s=0.0)
    assert ten == pytest.approx(tau / (tau + pause) * 10 * step / (10 * step + sigma)
                                * (1 - (10 * step + sigma) / 2 / mtbf))


def test_explain_shows_the_snapshots_and_says_when_the_hosts_memory_rules_them_out():
    from rich.console import Console

    from ptc.views.explain import render_explain

    def failures(plan) -> str:
        console = Console(width=80, record=True)
        console.print(render_explain(plan))
        text = " ".join(console.export_text().split())
        return text[text.index("Failures:"):]

    plan = load_plan(EXAMPLES / "llama7b_h100x8.ptc")
    text = failures(plan)
    assert "In-memory snapshots every step (snapshot_every = auto): " in text
    assert "of the node's 1.8 TiB host memory" in text and "with storage alone)" in text
    small = load_plan(EXAMPLES / "llama7b_h100x8.ptc", overrides={"hardware.host_memory": "64 GiB"})
    assert "In-memory snapshots: off (snapshot_every = auto: " in failures(small)
    none = load_plan(EXAMPLES / "llama7b_h100x8.ptc", overrides={"runtime.snapshot_every": "none"})
    assert "In-memory snapshots: off (snapshot_every = none)." in failures(none)
