"""`ptc estimate` prices train.dtype = fp8 as ptc's runtime runs it.

Llama-2-7B on 8 H100s (tp 2, sp, selective recompute): the layers' linears run their
three GEMMs at the fp8 peak (1979 TFLOP/s, twice bf16's 989), so their seconds halve;
attention, the LM head and everything else stay at the bf16 rate. Each linear also
quantises its operands, memory-bound casts at the HBM bandwidth: forward its input
x [M, K] and weight [N, K] (the amax read, the cast read, the float8 write: 5 bytes an
element), backward its output gradient [M, N] (5 bytes) and the weight again with the
forward's scale (3 bytes), for M tokens of a micro-batch; tp 2 divides each linear's
work as it divides the linear. The saved activations
change: each linear keeps its own float8 copy of its input (one byte an element, not
two): less for the attention output and MLP down projections, more for an input that
q, k and v read (three copies, 3 bytes, against one bf16 tensor's 2). A mixture of experts'
grouped products run in float8 too: a MoE layer's fp8 FLOPs include its experts'.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from ptc.compiler.cost.compute import Split, phase_work
from ptc.compiler.search.estimate import estimate
from ptc.compiler.profile.cache import model_profile, plan_profile
from ptc.dsl import load_plan

PLAN = Path(__file__).resolve().parents[2] / "examples" / "llama7b_h100x8.ptc"


def _with(plan, **train):
    return dataclasses.replace(plan, train=dataclasses.replace(plan.train, **train))


def _cast_seconds(plan, lay) -> float:
    """The seconds a step's float8 casts take on one rank (module docstring)."""
    m, h, ffn = lay.micro_batch * plan.train.seq_len, plan.model.hidden, plan.model.ffn
    linears = [(h, h)] * 4 + [(h, ffn)] * 2 + [(ffn, h)]  # (K, N): q, k, v, o; gate, up; down
    cast_bytes = sum(5 * (m * k + n * k) + 5 * m * n + 3 * n * k for k, n in linears)
    return lay.microbatches * lay.layers * cast_bytes / lay.tp / plan.hardware.mem_bandwidth


def test_fp8_gemms_take_half_the_time_of_bf16():
    plan = load_plan(PLAN)  # GEMMs priced by FLOPs alone (no tile model): the count below holds
    bf16 = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware,
                                                                  multiprocessors=0))
    fp8 = _with(bf16, dtype="fp8")
    e16, e8 = estimate(bf16), estimate(fp8)
    profile = model_profile(fp8.model, "fp8")
    lay, hw = e8.layout, fp8.hardware
    b, s = lay.micro_batch, fp8.train.seq_len
    gemm_flops = profile.fn["fp8_flops"](b, s)
    assert gemm_flops / profile.fn["flops.layer"](b, s) > 0.8  # the linears are most of a layer
    # Forward and backward of every layer's float8 GEMMs, per micro-batch, 1/tp per rank.
    bf16_gemm_s = lay.microbatches * 3 * lay.layers * gemm_flops / lay.tp / (
        hw.peak_flops["bf16"] * hw.achievable_fraction)
    fp8_gemm_s = bf16_gemm_s * hw.peak_flops["bf16"] / hw.peak_flops["fp8"]
    assert fp8_gemm_s == pytest.approx(bf16_gemm_s / 2, rel=0.01)
    assert e16.breakdown["compute"] - e8.breakdown["compute"] == \
        pytest.approx(bf16_gemm_s - fp8_gemm_s - _cast_seconds(fp8, e8.layout), rel=1e-6)
    assert e8.breakdown["recompute"] == pytest.approx(e16.breakdown["recompute"])  # attention
    assert e8.step_time_s < e16.step_time_s
    assert e8.mfu * e8.step_time_s == pytest.approx(e16.mfu * e16.step_time_s)  # bf16's peak


def test_fp8_saves_float8_copies_of_the_linears_inputs():
    bf16 = load_plan(PLAN)
    e16, e8 = estimate(bf16), estimate(_with(bf16, dtype="fp8"))
    act16, act8 = e16.memory_terms[0]["activations"], e8.memory_terms[0]["activations"]
    assert act8 < act16
    for term in ("weights", "grads", "optimizer"):  # bf16 weights, fp32 masters: unchanged
        assert e8.memory_terms[0][term] == e16.memory_terms[0][term]


def test_emulated_fp8_is_priced_at_the_bf16_rate_without_an_fp8_peak():
    plan = load_plan(PLAN)
    peaks = {k: v for k, v in plan.hardware.peak_flops.items() if k != "fp8"}
    plan = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware,
                                                                  peak_flops=peaks))
    emulated = _with(plan, dtype="fp8", fp8_emulate=True)
    priced = estimate(emulated)  # the GEMMs at bf16's rate, the casts beside them
    assert priced.breakdown["compute"] == pytest.approx(
        estimate(plan).breakdown["compute"] + _cast_seconds(emulated, priced.layout))


def _recipe_cast_seconds(plan, lay, recipe) -> float:
    """The seconds a step's rowwise or mxfp8 casts take on one rank: each operand quantised
    once per GEMM it feeds (5 bytes an element), a copy laid out transposed for its GEMM
    2 bytes more (x's and the output gradient's along M, the weight's along N), mxfp8's
    E8M0 scales one byte per 32 elements (`profile.fp8.fp8_casts`)."""
    m, h, ffn = lay.micro_batch * plan.train.seq_len, plan.model.hidden, plan.model.ffn
    linears = [(h, h)] * 4 + [(h, ffn)] * 2 + [(ffn, h)]
    per_element = 1 / 32 if recipe == "mxfp8" else 0
    cast_bytes = 0.0
    for k, n in linears:
        x, w, out = m * k, n * k, m * n
        forward = (5 + per_element) * (2 * x + w) + 2 * x
        backward = (5 + per_element) * (2 * out + w) + 2 * out + 2 * w
        cast_bytes += forward + backward
    return lay.microbatches * lay.layers * cast_bytes / lay.tp / plan.hardware.mem_bandwidth


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_rowwise_and_mxfp8_pay_their_extra_casts_at_the_same_gemm_rate(recipe):
    """The GEMMs stay at the fp8 peak (no per-recipe efficiency): the step differs from
    tensorwise's by the casts alone."""
    plan = load_plan(PLAN)
    plan = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware,
                                                                  multiprocessors=0))
    tensorwise = _with(plan, dtype="fp8", fp8_scaling="current")
    other = _with(tensorwise, fp8_recipe=recipe)
    e8, er = estimate(tensorwise), estimate(other)
    assert er.layout == e8.layout
    extra = _recipe_cast_seconds(other, er.layout, recipe) - _cast_seconds(tensorwise, e8.layout)
    assert er.breakdown["compute"] - e8.breakdown["compute"] == pytest.approx(extra, rel=1e-6)
    assert er.step_time_s > e8.step_time_s


def test_a_moe_layers_float8_gemms_include_its_routed_experts():
    """The tiny Mixtral (hidden 32; 4 query and 2 key/value heads of 8; a router over 4
    experts of 64, top-2): per token its attention's linears' forward takes 2·(32·32 +
    2·32·16 + 32·32) FLOPs, its experts' grouped products 2·2·(32·128 + 64·32) (two rows a
    token, gate_up then down), four fifths of the layer's. fp8_flops counts both, so the
    cost model runs them at the fp8 rate, forward, and dgrad and wgrad backward; the
    router's 2·32·4 stays at bf16's (its scores pick the experts, kept in high precision as
    Megatron-Core keeps them)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
    from hf_helpers import HFCase, hf_plan  # noqa: PLC0415 - the transformers test models

    plan = _with(hf_plan(HFCase("mixtral")), dtype="fp8", fp8_emulate=True)
    profile = plan_profile(plan)
    f = profile.fn
    for b, s in ((1, 16), (2, 8), (3, 5)):
        tokens = b * s
        linears = 2 * tokens * (32 * 32 + 2 * 32 * 16 + 32 * 32)
        experts = 2 * 2 * tokens * (32 * 128 + 64 * 32)
        router = 2 * tokens * 32 * 4
        assert f["fp8_flops"](b, s) == linears + experts
        assert f["fp8_flops"](b, s) + router == f["work.layer.fwd.gemm.all"](b, s)  # every GEMM
        split = Split(tp=1, kv_divisor=1, sp=False, cp=1)
        for phase, times in (("fwd", 1), ("bwd", 2)):
            work = phase_work(profile, "layer", phase, b, s, split, s)
            assert (work.gemm, work.fp8) == (times * router, times * (linears + experts))
    assert experts / (linears + experts) > 0.79
