"""Uneven pipeline splits (first/last_stage_layers, layer cuts) priced stage by stage.

A 30-layer model on pp = 8 (30 is not a multiple of 8) with 3 layers on the
first and the last stage leaves 4 on each of the six others, as Megatron-LM's
--decoder-first/last-pipeline-num-layers do for 126 layers on 8 or 16 stages.
"""

from __future__ import annotations

import pytest

from ptc.compiler.cost.compute import Split, layer_times, rates
from ptc.compiler.search.estimate import estimate
from ptc.compiler.profile.cache import model_profile, with_model_shape
from ptc.compiler.shapes import plan_from_shape
from ptc.errors import PlanError

SHAPE = dict(family="gpt", hidden=128, heads=4, vocab=256, seq_len=64, gpu="H100-SXM",
             num_gpus=8, tp=1, pp=8, dp=1, global_batch=16, dtype="bf16")


def test_the_end_counts_are_the_first_and_last_ranks_under_interleaving():
    # Llama 3 405B's split: 126 layers on pp 16, one layer fewer on the first and last rank.
    par = _plan(126, pp=16, dp=1, num_gpus=16, schedule="interleaved", virtual_stages=2,
                first_stage_layers=7, last_stage_layers=7).parallel
    counts = par.stage_layers(126)
    per_rank = [counts[r] + counts[r + 16] for r in range(16)]
    assert per_rank == [7] + [8] * 14 + [7]
    # The first rank's shorter stage beside the embedding, the last rank's beside the loss.
    assert (counts[0], counts[16]) == (3, 4) and (counts[15], counts[31]) == (4, 3)
    with pytest.raises(PlanError, match=r"parallel\.first_stage_layers: error: "
                                        r"first_stage_layers\(1\) leaves 2 of that rank's "
                                        r"virtual_stages\(3\) without a layer; at most its "
                                        r"first may hold none"):
        _plan(48, schedule="interleaved", virtual_stages=3, first_stage_layers=1)


def test_an_end_stage_may_hold_the_embedding_or_the_loss_alone():
    """Megatron-LM's --account-for-embedding/loss-in-pipeline-split with one layer per virtual
    stage (Llama 3 405B on pp 16, v 8): the first rank's first stage holds only the
    embedding, the last rank's last stage only the head and the loss."""
    par = _plan(126, pp=16, dp=1, num_gpus=16, schedule="interleaved", virtual_stages=8,
                first_stage_layers=7, last_stage_layers=7).parallel
    counts = par.stage_layers(126)
    assert counts == (0,) + (1,) * 126 + (0,)
    plan = _plan(14, pp=8, schedule="interleaved", virtual_stages=2, first_stage_layers=1,
                 last_stage_layers=1, global_batch=32)
    est = estimate(plan)
    assert est.layout.chunk_layers == (0,) + (1,) * 14 + (0,)
    assert [list(r) for r in est.layout.chunks(0)] == [[], [7]]
    assert [list(r) for r in est.layout.chunks(7)] == [[6], []]
    # The rank beside the embedding alone holds two layers' worth less than the middle ones.
    assert est.stage_memory_bytes[0] < est.stage_memory_bytes[3]
    assert est.fits and est.step_time_s > 0


def _plan(layers: int, **kw):
    return plan_from_shape(**{**SHAPE, "layers": layers, **kw})


def test_layers_indivisible_by_pp_need_the_split():
    with pytest.raises(PlanError, match=r"layers\(30\) is not divisible by pp\(8\) \* "
                                        r"virtual_stages\(1\) = 8; give the uneven split"):
        _plan(30)
    plan = _plan(30, first_stage_layers=3, last_stage_layers=3)
    assert plan.parallel.stage_layers(30) == (3, 4, 4, 4, 4, 4, 4, 3)


def test_one_end_given_and_a_remainder():
    par = _plan(30, first_stage_layers=2).parallel
    # 28 layers over 7 stages: 4 each.
    assert par.stage_layers(30) == (2, 4, 4, 4, 4, 4, 4, 4)
    par = _plan(31, last_stage_layers=3).parallel
    # 28 over the first 7 stages: 4 each; an uneven rest goes to the later stages.
    assert par.stage_layers(31) == (4, 4, 4, 4, 4, 4, 4, 3)
    assert _plan(30, last_stage_layers=4).parallel.stage_layers(30) == (3, 3, 4, 4, 4, 4, 4, 4)


@pytest.mark.parametrize("kw,needle", [
    (dict(first_stage_layers=20, last_stage_layers=8), r"parallel\.first_stage_layers: error: "
     r"first_stage_layers\(20\) \+ last_stage_layers\(8\) leave 2 of layers\(30\) for the other "
     r"6 of pp\(8\)"),
    (dict(last_stage_layers=30), r"parallel\.last_stage_layers: error: last_stage_layers\(30\) "
     r"leave 0 of layers\(30\)"),
    (dict(first_stage_layers=3, stage_boundaries=(None,) * 7),
     r"first_stage_layers needs no stage_boundaries"),
    (dict(stage_boundaries=(None, None, "layers.9", None, None, "norm", None)),
     r"parallel\.stage_boundaries: error: stage_boundaries: cut 'norm' \(stage 6\) names no "
     r"layer"),
])
def test_splits_that_do_not_fit_name_the_field(kw, needle):
    with pytest.raises(PlanError, match=needle) as info:
        _plan(30, **kw)
    assert len(str(info.value).splitlines()) == 1


def test_stage_boundaries_at_layers_price_the_split():
    cuts = ("layers.3", None, None, None, None, None, "layers.27")
    plan = _plan(30, stage_boundaries=cuts)
    assert estimate(plan).layout.chunk_layers == (3, 4, 4, 4, 4, 4, 4, 3)


def test_estimate_prices_each_stage():
    """Slowest-stage time and per-stage memory from the per-layer figures by hand."""
    plan = _plan(30, first_stage_layers=3, last_stage_layers=3)
    est = estimate(plan)
    layout = est.layout
    assert layout.chunk_layers == (3, 4, 4, 4, 4, 4, 4, 3)
    assert [len(layout.stage_layers(i)) for i in range(8)] == [3, 4, 4, 4, 4, 4, 4, 3]

    profile = model_profile(with_model_shape(plan).model, "bf16")
    t = layer_times(profile, rates(plan.hardware, "bf16"), bb=1, ss=64, seq_len=64,
                    split=Split(tp=1, kv_divisor=1, sp=False, cp=1))
    m, p = layout.microbatches, 8
    layer = t.forward + t.backward
    stage_time = [3 * layer + t.pre] + [4 * layer] * 6 + [3 * layer + t.post]
    assert max(stage_time) == stage_time[1]  # a 4-layer stage, not an end, is the slowest
    # tp = dp = 1 and overlap on: compute is all a stage does; m x the slowest, plus the bubble.
    assert est.breakdown["compute"] == pytest.approx(m * max(stage_time))
    assert est.breakdown["bubble"] == pytest.approx((p - 1) * sum(stage_time) / p)

    # Each stage's memory is what a stage holding as many layers costs in an even split.
    even = {n: estimate(_plan(8 * n)) for n in (3, 4)}
    for stage, n in enumerate(layout.chunk_layers):
        assert est.memory_terms[stage] == pytest.approx(even[n].memory_terms[stage])
    assert est.stage_memory_bytes[1] > est.stage_memory_bytes[7]
    assert est.peak_memory_bytes == max(est.stage_memory_bytes)


def test_uneven_split_is_not_priced_as_even():
    uneven = estimate(_plan(32, first_stage_layers=1, last_stage_layers=1))
    even = estimate(_plan(32))
    assert uneven.layout.chunk_layers == (1, 5, 5, 5, 5, 5, 5, 1)
    # The 5-layer stages set the pace: slower than any stage of the even split.
    t = layer_times(model_profile(with_model_shape(_plan(32)).model, "bf16"),
                    rates(_plan(32).hardware, "bf16"), bb=1, ss=64, seq_len=64,
                    split=Split(tp=1, kv_divisor=1, sp=False, cp=1))
    m = uneven.layout.microbatches
    assert uneven.breakdown["compute"] == pytest.approx(m * 5 * (t.forward + t.backward))
    assert uneven.breakdown["compute"] > even.breakdown["compute"]
    assert uneven.stage_memory_bytes[1] > even.stage_memory_bytes[1]


def test_interleaved_chunks_split_unevenly():
    # The first rank holds 3 layers in its 2 virtual stages, the last 5 (Megatron-LM's
    # first/last pipeline stage counts): 1 + 2 and 3 + 2, the shorter stage beside the
    # embedding on the first rank and beside the loss on the last.
    plan = _plan(32, schedule="interleaved", virtual_stages=2, first_stage_layers=3,
                 last_stage_layers=5)
    layout = estimate(plan).layout
    assert layout.chunk_layers == (1,) + (2,) * 6 + (3,) + (2,) * 7 + (2,)
    assert [list(r) for r in layout.chunks(0)] == [[0], [16, 17]]
    assert [list(r) for r in layout.chunks(7)] == [[13, 14, 15], [30, 31]]
    assert estimate(plan).fits
