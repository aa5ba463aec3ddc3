"""The memory and cost models price a module a `shard ... replicate` rule keeps whole as the
lowered graph runs it: whole weights and compute, fewer tp collectives, and under sequence
parallelism the gathers around what runs whole. The held and saved bytes of such plans are
compared with a run in tests/memory/test_model_state.py and
tests/distributed/test_recompute_memory.py."""

from __future__ import annotations

import dataclasses

import pytest

from ptc.compiler.cost.tp_exposure import BoundaryCollectives, LinearTimes, layer_tp_time
from ptc.compiler.search.estimate import estimate
from ptc.compiler.profile.cache import model_profile, plan_profile
from ptc.compiler.shapes import plan_from_shape
from ptc.plan import ModelSpec, ShardRule

LLAMA = ModelSpec(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128,
                  max_seq=16)
HEAD_DIM = LLAMA.hidden // LLAMA.heads
MLP_WHOLE = (ShardRule(pattern="layers.*.mlp.*", style="replicate"),)
ATTENTION_WHOLE = (ShardRule(pattern="layers.*.attn.*", style="replicate"),)


def test_a_block_kept_whole_is_held_whole_and_leaves_one_tp_region():
    inferred, kept = model_profile(LLAMA, "fp32"), model_profile(LLAMA, "fp32", MLP_WHOLE)
    mlp = 3 * LLAMA.hidden * LLAMA.ffn  # gate, up, down: no biases
    assert kept.params["layer"].split == inferred.params["layer"].split - mlp
    assert kept.params["layer"].replicated == inferred.params["layer"].replicated + mlp
    assert (inferred.tp_entries, inferred.tp_exits) == (2, 2)  # attention and MLP
    assert (kept.tp_entries, kept.tp_exits) == (1, 1)  # attention only
    each = BoundaryCollectives(all_gather=1.0, reduce_scatter=1.0, all_reduce=2.0)

    def issued(profile, sp: bool, rerun: bool) -> float:
        return layer_tp_time(profile, tp=2, sp=sp, async_tp=False, overlap=False,
                             rerun_layer=rerun, regathers=0, each=each,
                             linears=LinearTimes(0.0, 0.0), exposed_extra=0.0).issued

    for sp in (False, True):
        for rerun in (False, True):
            assert issued(kept, sp, rerun) == issued(inferred, sp, rerun) / 2


def test_a_whole_attention_under_sequence_parallelism_runs_on_the_whole_sequence():
    """Its work is the same on every rank, at tp 2 as at tp 1, but for the projections that
    read the rank's part of the sequence; with tp splitting it, a rank does about half."""
    from ptc.compiler.cost.compute import Split, phase_work  # noqa: PLC0415

    def attention_flops(shards, tp):
        profile = model_profile(LLAMA, "fp32", shards)
        split = Split(tp=tp, kv_divisor=tp, sp=tp > 1, cp=1)
        return phase_work(profile, "core", "fwd", 2, 16, split, 16).gemm + \
            phase_work(profile, "core", "fwd", 2, 16, split, 16).attention

    assert attention_flops(ATTENTION_WHOLE, 2) == attention_flops(ATTENTION_WHOLE, 1) > 0
    assert attention_flops((), 2) == pytest.approx(attention_flops((), 1) / 2)


def test_a_whole_attention_under_sequence_parallelism_gathers_q_k_v_and_scatters_its_output():
    profile = model_profile(LLAMA, "fp32", ATTENTION_WHOLE)
    b, s = 3, 8
    q, kv = LLAMA.heads * HEAD_DIM, LLAMA.num_kv_heads * HEAD_DIM
    assert profile.fn["sp_gathered"](b, s) == 4 * b * s * (q + 2 * kv)  # fp32 q, k, v
    assert profile.fn["sp_scattered"](b, s) == 4 * b * s * LLAMA.hidden  # the o projection's
    assert model_profile(LLAMA, "fp32").fn["sp_gathered"](b, s) == 0  # tp splits it: no gather


@pytest.mark.parametrize("sp", [False, True])
def test_the_estimate_prices_the_whole_mlp_as_computed_and_held_whole(sp):
    shape = dict(family="llama", layers=8, hidden=1024, heads=16, kv_heads=8, ffn=4096,
                 vocab=8192, seq_len=1024, global_batch=8, gpu="H100-SXM", num_gpus=4, tp=4,
                 pp=1, dp=1, sequence_parallel=sp, overlap=False)  # tp traffic all exposed
    inferred = plan_from_shape(**shape)
    # GEMMs priced by their FLOPs alone: the same FLOPs in other shapes take as long
    inferred = dataclasses.replace(inferred, hardware=dataclasses.replace(
        inferred.hardware, multiprocessors=0))
    kept = dataclasses.replace(inferred, parallel=dataclasses.replace(
        inferred.parallel, shards=MLP_WHOLE))
    assert plan_profile(kept).tp_exits == 1
    split, whole = estimate(inferred), estimate(kept)
    assert whole.breakdown["tp_comm"] < split.breakdown["tp_comm"]
    if sp:  # the whole MLP runs on the rank's part of the sequence: as many FLOPs
        assert whole.breakdown["compute"] == pytest.approx(split.breakdown["compute"])
    else:  # on all of it
        assert whole.breakdown["compute"] > split.breakdown["compute"]
    mlp_bytes = 3 * 1024 * 4096 * 8 * 2  # bf16 weights of 8 layers' MLPs
    assert whole.memory_terms[0]["weights"] - split.memory_terms[0]["weights"] == \
        pytest.approx(mlp_bytes * (1 - 1 / 4))


@pytest.mark.parametrize("pattern", ["layers.0.mlp.*", "layers.1.mlp.down"])
def test_rules_that_place_layers_unlike_leave_the_plan_unpriced(pattern):
    """The profile prices every layer as layer 0: a rule placing one layer's module unlike
    another's gets no (silently wrong) prediction but an UnpricedError naming both."""
    from ptc.errors import UnpricedError  # noqa: PLC0415

    with pytest.raises(UnpricedError, match=r"layers\.0\.mlp\.down .*layers\.1\.mlp\.down"):
        model_profile(LLAMA, "fp32", (ShardRule(pattern=pattern, style="replicate"),))


def test_rules_that_name_layers_but_place_them_alike_are_priced():
    """A rule naming every layer, or the only layer, places the layers alike."""
    every = (ShardRule(pattern="layers.[01].mlp.*", style="replicate"),)
    assert model_profile(LLAMA, "fp32", every) == model_profile(LLAMA, "fp32", MLP_WHOLE)
    one = dataclasses.replace(LLAMA, layers=1)
    first = (ShardRule(pattern="layers.0.mlp.*", style="replicate"),)
    assert model_profile(one, "fp32", first).params == model_profile(one, "fp32", MLP_WHOLE).params
