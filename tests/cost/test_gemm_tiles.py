"""GEMMs priced at their shape: tile and wave quantisation, and the shapes each rank runs.

The efficiencies below are derived by hand from the tile rule (NVIDIA's "Matrix
Multiplication Background" guide: tiles of the output run one per SM, in
waves); the shapes each rank runs are checked against the FLOPs the profile
measures for the same region, phase and split, which `rank_shapes` does not
read.
"""

from __future__ import annotations

import dataclasses

import pytest

from ptc.compiler.cost.compute import Split, layer_times, phase_work, rates
from ptc.compiler.graph.gemm_tiles import efficiency, rank_shapes, tile_efficiency
from ptc.compiler.profile.cache import model_profile
from ptc.plan import HardwareSpec, ModelSpec, ShardRule

pytestmark = pytest.mark.timeout(300)

A100_SMS = 108


def test_an_output_of_exactly_one_full_wave_wastes_nothing():
    # 3072 x 1152 is 12 x 9 = 108 tiles of 256 x 128: one per SM, one wave
    assert tile_efficiency(1, 3072, 1152, A100_SMS) == 1.0


def test_one_tile_past_a_full_wave_costs_a_wave():
    # 13 952 x 128 (109 rows of 128): 256 x 128 tiles make 55 tiles in one wave of 108,
    # 128 x 128 make 109 in two; 128 x 64 and 64 x 128 make 218 in three waves of 108 =
    # 324 slots of 128·64 elements: 13 952·128 / (324·8192) = 0.6728, the least waste.
    assert tile_efficiency(1, 13952, 128, A100_SMS) == pytest.approx(13952 * 128 / (324 * 8192))


def test_a_tiny_output_keeps_one_sm_partly_busy_and_the_rest_idle():
    # one 64 x 64 output: one 128 x 64 tile, half used, on 1 of 108 SMs
    assert tile_efficiency(1, 64, 64, A100_SMS) == pytest.approx(64 * 64 / (108 * 128 * 64))


def test_batched_products_fill_the_waves_together():
    # 12 products of 256 x 1152: 9 tiles each, 108 in all: one full wave
    assert tile_efficiency(12, 256, 1152, A100_SMS) == 1.0


GPT = ModelSpec(family="gpt", layers=1, hidden=64, heads=4, vocab=128, max_seq=64)
LLAMA_GQA = ModelSpec(family="llama", layers=1, hidden=64, heads=4, kv_heads=2, ffn=128,
                      vocab=128, max_seq=64)
ATTENTION_WHOLE = (ShardRule(pattern="layers.*.attn.*", style="replicate"),)


HF = "tests.user_models.transformers_models"


@pytest.mark.parametrize("spec,shards", [
    (GPT, ()), (LLAMA_GQA, ()), (LLAMA_GQA, ATTENTION_WHOLE),
    (ModelSpec(family="custom", factory=f"{HF}:gpt2"), ()),  # Conv1D: weights stored [in, out]
    (ModelSpec(family="custom", factory=f"{HF}:gpt_bigcode"), ()),  # one key/value head
    (ModelSpec(family="custom", factory=f"{HF}:phi3"), ()),  # q, k, v in one linear
], ids=["gpt", "llama-gqa", "llama-attention-whole", "hf-gpt2", "hf-gpt-bigcode", "hf-phi3"])
def test_the_shapes_each_rank_runs_add_up_to_its_measured_gemm_flops(spec, shards):
    """For every region and phase, tp 1, 2 and 4, with and without sequence parallelism,
    one sample and three: the GEMMs `rank_shapes` says a rank runs do the FLOPs the profile
    measured for that rank (the tp, kv and sequence-parallel classes of `phase_work`)."""
    profile = model_profile(spec, "fp32", shards)
    regions = ("pre", "layer", "post", "core", *(f"rerun[{p}]" for p in profile.policy_flops))
    checked = 0
    for tp in (1, 2, 4):
        for sp in (False, True) if tp > 1 else (False,):
            split = Split(tp=tp, kv_divisor=profile.kv_divisor(tp), sp=sp, cp=1)
            for bb, ss in ((1, 16), (3, 32)):
                shapes_of = profile.gemms_b1 if bb == 1 else profile.gemms
                for region in regions:
                    for phase in ("fwd", "bwd") if not region.startswith("rerun") else ("fwd",):
                        measured = phase_work(profile, region, phase, bb, ss, split, ss).gemm
                        dims = rank_shapes(shapes_of[f"{region}.{phase}"], bb, ss, tp=tp,
                                           kv_divisor=split.kv_divisor, sp=sp)
                        shaped = sum(2 * d["batch"] * d["m"] * d["n"] * d["k"] for d in dims)
                        assert shaped == pytest.approx(measured), (region, phase, tp, sp, bb)
                        checked += measured > 0
    assert checked > 50


def test_tensor_parallelism_divides_the_dimension_its_weights_split():
    """GPT's layer at tp 2: the qkv and MLP-up linears (column-parallel) produce half the
    features, the out and MLP-down ones (row-parallel) contract over half; the attention's
    products run half the heads."""
    profile = model_profile(GPT, "fp32")
    h, bb, ss = GPT.hidden, 2, 32
    one = rank_shapes(profile.gemms["layer.fwd"], bb, ss, tp=1, kv_divisor=1, sp=False)
    two = rank_shapes(profile.gemms["layer.fwd"], bb, ss, tp=2, kv_divisor=2, sp=False)
    as_mnk = {(d["m"], d["n"], d["k"]): d for d in one}
    assert (bb * ss, 3 * h, h) in as_mnk and (bb * ss, 4 * h, h) in as_mnk  # qkv, up
    halved = {(d["batch"], d["m"], d["n"], d["k"]) for d in two}
    assert (1, bb * ss, 3 * h // 2, h) in halved and (1, bb * ss, 2 * h, h) in halved  # columns
    assert (1, bb * ss, h, h // 2) in halved and (1, bb * ss, h, 2 * h) in halved  # rows
    heads = GPT.heads * bb
    assert any(d["batch"] == heads for d in one) and any(d["batch"] == heads // 2 for d in two)


def test_narrow_per_rank_gemms_cost_more_per_flop_on_a_gpu():
    """The same layer's GEMMs split eight ways waste more of an H100's waves than whole;
    priced by FLOPs alone (no SMs, as on a CPU) they would not."""
    profile = model_profile(GPT, "fp32")
    shapes = profile.gemms["layer.fwd"]
    whole = efficiency(shapes, 2, 64, tp=1, kv_divisor=1, sp=False, multiprocessors=132)
    split = efficiency(shapes, 2, 64, tp=4, kv_divisor=4, sp=False, multiprocessors=132)
    assert split < whole < 1
    hw = HardwareSpec.preset("H100-SXM")
    flat = dataclasses.replace(hw, multiprocessors=0)
    args = dict(bb=2, ss=64, seq_len=64, split=Split(4, 4, False, 1))
    tiled, by_flops = (layer_times(profile, rates(x, "fp32"), **args) for x in (hw, flat))
    assert tiled.forward > by_flops.forward


def test_a_measured_gemm_rate_is_not_quantised_again():
    """`ptc calibrate` measures the GEMM rate at the plan's own shapes: that rate prices the
    FLOPs as they are."""
    hw = dataclasses.replace(HardwareSpec.preset("H100-SXM"), gemm_flops={"bf16": 6e14})
    assert rates(hw, "bf16").multiprocessors == 0
    assert rates(HardwareSpec.preset("H100-SXM"), "bf16").multiprocessors == 132
    assert rates(HardwareSpec.preset("cpu"), "fp32").multiprocessors == 0


def test_explain_shows_the_share_of_waves_a_layers_gemms_use():
    """`ptc explain` on a GPU prints the layer GEMMs' share of full waves at the plan's
    per-rank shapes; on the CPU (GEMMs priced by FLOPs) the row is absent."""
    import io  # noqa: PLC0415

    from rich.console import Console  # noqa: PLC0415

    from ptc.compiler.cost.compute import tile_efficiency as layer_phase_efficiency  # noqa: PLC0415
    from ptc.views.explain import render_explain  # noqa: PLC0415
    from ptc.compiler.shapes import plan_from_shape  # noqa: PLC0415

    def shown(gpu):
        plan = plan_from_shape(family="gpt", layers=2, hidden=64, heads=4, vocab=128, seq_len=64,
                               global_batch=8, gpu=gpu, num_gpus=2, tp=2, pp=1, dp=1,
                               micro_batch=2, dtype="fp32")
        out = io.StringIO()
        Console(file=out, width=400).print(render_explain(plan))
        return out.getvalue()

    profile = model_profile(GPT, "fp32")
    forward, backward = (layer_phase_efficiency(profile, "layer", phase, 2, 64,
                                                Split(2, 2, False, 1), 132)
                         for phase in ("fwd", "bwd"))
    assert f"{forward:.1%} forward, {backward:.1%} backward" in shown("H100-SXM")
    assert "GEMM waves used" in shown("H100-SXM") and "GEMM waves used" not in shown("cpu")
