"""Step-time model: its parts, its conventions, and the public Estimate."""

from __future__ import annotations

import dataclasses

import pytest

from ptc.compiler.cost.compute import Split, layer_times, rates
from ptc.compiler.search.estimate import estimate
from ptc.compiler.profile.cache import model_profile
from ptc.compiler.shapes import plan_from_shape

SHAPE = dict(family="gpt", layers=8, hidden=256, heads=8, vocab=512, seq_len=128,
             global_batch=64, gpu="H100-SXM")


def _plan(**kw):
    return plan_from_shape(**{**SHAPE, **kw})


def test_estimate_fields_are_consistent():
    plan = _plan(num_gpus=8, tp=2, pp=2, dp=2, sequence_parallel=True, zero=1)
    est = estimate(plan)
    gpus = 8
    assert est.step_time_s == pytest.approx(sum(est.breakdown.values()))
    assert est.tokens_per_s == pytest.approx(64 * 128 / est.step_time_s)
    assert est.mfu == pytest.approx(est.tflops_per_gpu * 1e12 / 989e12)
    assert len(est.stage_memory_bytes) == 2
    assert est.peak_memory_bytes == max(est.stage_memory_bytes)
    assert est.hw_tflops_per_gpu == pytest.approx(est.tflops_per_gpu)  # no recompute
    assert gpus == est.layout.tp * est.layout.pp * est.layout.dp


def test_gpus_that_do_not_fill_nodes_are_refused():
    """256 GPUs are not nodes of a GB200 rack's 72: the caller says the 64 per rack it uses."""
    with pytest.raises(ValueError, match=r"num_gpus\(256\) is not a multiple of "
                                         r"gpus_per_node\(72\)"):
        _plan(gpu="GB200", num_gpus=256, tp=4, pp=4)
    plan = _plan(gpu="GB200", num_gpus=256, tp=4, pp=4, gpus_per_node=64)
    assert (plan.hardware.nodes, plan.hardware.gpus_per_node) == (4, 64)


def test_full_recompute_costs_one_more_forward():
    plan = _plan(num_gpus=1, tp=1, pp=1, dp=1, checkpoint="full")
    est = estimate(plan)
    assert est.hw_tflops_per_gpu / est.tflops_per_gpu == pytest.approx(4 / 3, rel=0.02)
    times = layer_times(model_profile(plan.model, "bf16"), rates(plan.hardware, "bf16"),
                        bb=1, ss=128, seq_len=128, split=Split(tp=1, kv_divisor=1, sp=False, cp=1))
    m, layers = est.layout.microbatches, 8
    assert est.breakdown["recompute"] == pytest.approx(m * layers * times.forward)
    assert est.breakdown["compute"] == pytest.approx(
        m * (layers * (times.forward + times.backward) + times.pre + times.post))


@pytest.mark.parametrize("v", [1, 2])
def test_bubble_is_p_minus_1_over_v_m(v):
    plan = _plan(num_gpus=4, tp=1, pp=4, dp=1, micro_batch=8,
                 schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v)
    est = estimate(plan)
    m = est.layout.microbatches
    per_micro = est.breakdown["compute"] / m
    # Stages are nearly equal here (embedding and head are small).
    assert est.breakdown["bubble"] == pytest.approx(3 / v * per_micro, rel=0.15)


def test_overlap_hides_data_parallel_traffic():
    base = dict(num_gpus=16, tp=1, pp=1, dp=16)
    hidden, exposed = estimate(_plan(**base, overlap=True)), estimate(_plan(**base, overlap=False))
    assert hidden.breakdown["dp_comm"] < exposed.breakdown["dp_comm"]
    assert exposed.breakdown["dp_comm"] > 0


def test_zero3_moves_traffic_every_micro_batch():
    plan = _plan(num_gpus=16, tp=1, pp=1, dp=16, zero=3, overlap=False)
    z0 = estimate(dataclasses.replace(plan, parallel=dataclasses.replace(plan.parallel, zero=0)))
    assert estimate(plan).breakdown["dp_comm"] > z0.breakdown["dp_comm"]


def test_auto_checkpoint_fits_with_least_recompute():
    plan = _plan(num_gpus=1, tp=1, pp=1, dp=1, micro_batch=64, checkpoint="auto")
    tight = dataclasses.replace(plan.hardware, hbm_bytes=estimate(
        _plan(num_gpus=1, tp=1, pp=1, dp=1, micro_batch=64, checkpoint="selective")
    ).peak_memory_bytes * 1.01)
    est = estimate(dataclasses.replace(plan, hardware=tight))
    assert est.fits
    assert est.hw_tflops_per_gpu > est.tflops_per_gpu  # some layers recompute


@pytest.mark.parametrize("grad_dtype,comm,bytes_per_element", [
    ("fp32", "none", 4), ("bf16", "none", 2), ("bf16", "fp8", 1), ("fp32", "fp8_e5m2", 1)])
def test_gradient_all_reduce_is_priced_at_the_bytes_it_moves(grad_dtype, comm,
                                                             bytes_per_element):
    """Exposed ZeRO-0 gradient sync scales with the bytes per element on the wire: the
    gradient dtype, or one byte with float8 (`parallel.grad_comm`)."""
    # Wide enough (1.6 billion parameters) that bandwidth, not latency, sets the time.
    plan = _plan(num_gpus=16, tp=1, pp=1, dp=16, overlap=False, dtype="bf16", hidden=4096,
                 heads=32)

    def dp_comm(grad_dtype: str, comm: str) -> float:
        changed = dataclasses.replace(
            plan, train=dataclasses.replace(plan.train, grad_dtype=grad_dtype),
            parallel=dataclasses.replace(plan.parallel, grad_comm=comm))
        return estimate(changed).breakdown["dp_comm"]

    ratio = dp_comm(grad_dtype, comm) / dp_comm("fp32", "none")
    # The bandwidth term scales with the bytes; the latency term does not, hence the margin.
    assert bytes_per_element / 4 <= ratio < bytes_per_element / 4 * 1.1


@pytest.mark.parametrize("gpu,zero", [("H100-SXM", 1), ("A100-80GB", 3)])
def test_offloaded_optimizer_is_priced_at_the_host_link_and_cpu_adam(gpu, zero):
    """`parallel.offload = optimizer`: the fp32 gradient shard down and the weights up over
    the host link (PCIe Gen5 x16 on H100, Gen4 on A100, per direction), the node's CPU
    stepping all its ranks' shards, pipelined over the units. Here the CPU is the slowest of
    the three by far (8 ranks' Adam against a 4-byte copy), so the step waits for the first
    unit's gradient, the CPU's whole step, and at ZeRO-1 what is left of the last units'
    bf16 weights going up (the tiny final norm steps faster than the last layer's weights
    travel: both show); at ZeRO-3 they hide behind the next forward, as far as it lasts
    (this model's outlasts them). Every other copy is hidden. The rest of the step is unchanged, and the host memory per rank is reported."""
    from ptc.compiler.cost.step import CPU_ADAM_ELEMENTS_PER_S, _stage_units, offloaded_step
    from ptc.compiler.memory.model import stage_params
    from ptc.compiler.profile.cache import model_profile

    plan = _plan(num_gpus=8, tp=1, pp=1, dp=8, zero=zero, dtype="bf16", gpu=gpu)
    offloaded = dataclasses.replace(plan, parallel=dataclasses.replace(plan.parallel,
                                                                       offload="optimizer"))
    before, after = estimate(plan), estimate(offloaded)
    profile = model_profile(plan.model, "bf16")
    split, whole, _ = stage_params(profile, after.layout, 0)
    units = [u / 8 for u in _stage_units(profile, after.layout, 0)]
    assert sum(units) == pytest.approx((split + whole) / 8)
    assert len(units) == 8 + 2  # the embedding, 8 layers, the final norm (head tied)
    link = {"H100-SXM": 64e9, "A100-80GB": 32e9}[gpu]
    assert offloaded.hardware.host_bandwidth == link
    up = 2 if zero == 1 else 4  # the weights the graph reads: bf16 / ZeRO-3's fp32 shard
    cpu = 8 * sum(units) / CPU_ADAM_ELEMENTS_PER_S
    first = units[0] * 4 / link + cpu  # when the CPU is done
    tail = after.breakdown["optimizer"] - first
    if zero == 1:
        assert 0 < tail <= (units[-2] + units[-1]) * up / link
    else:
        assert tail == pytest.approx(0, abs=1e-12)
    if zero == 3:
        unhidden = offloaded_step(units, offloaded.hardware, weight_bytes=4).exposed
        assert tail < unhidden - first
    serial = sum(units) * (4 + up) / link + cpu
    assert after.hidden["optimizer"] == pytest.approx(serial - after.breakdown["optimizer"])
    assert {k: v for k, v in after.breakdown.items() if k != "optimizer"} == \
        {k: v for k, v in before.breakdown.items() if k != "optimizer"}
    assert after.host_memory_bytes > 0 == before.host_memory_bytes
    assert after.peak_memory_bytes < before.peak_memory_bytes


def test_search_keeps_a_zero_stage_when_offloading():
    from ptc.compiler.search.plan_search import enumerate_layouts

    plan = _plan(num_gpus=8, tp="auto", pp=1, dp="auto", zero=1)
    plan = dataclasses.replace(plan, parallel=dataclasses.replace(plan.parallel,
                                                                  offload="optimizer"))
    layouts = enumerate_layouts(plan)
    assert layouts and all(lay.zero >= 1 and lay.offload for lay in layouts)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_split_backwards_w_is_the_linears_weight_gradient_gemms(tp):
    """W's FLOPs are dW = dYᵀX of each linear, its forward's: 2·b·s per weight element.
    GPT's layer has 12h² of them (qkv 3h², out h², up and down 4h² each), the head h·V;
    tp divides both. Attention's QKᵀ and PV (activations times activations) are not W's."""
    from ptc.compiler.cost.compute import weight_gradient_work
    plan = _plan(num_gpus=1, tp=1, pp=1, dp=1)
    profile, (b, s) = model_profile(plan.model, "bf16"), (2, 128)
    split = Split(tp=tp, kv_divisor=tp, sp=False, cp=1)
    h, vocab = SHAPE["hidden"], SHAPE["vocab"]
    layer = weight_gradient_work(profile, "layer", b, s, split, 128)
    head = weight_gradient_work(profile, "post", b, s, split, 128)
    assert layer.gemm == pytest.approx(2 * b * s * 12 * h * h / tp, rel=1e-9)
    assert head.gemm == pytest.approx(2 * b * s * h * vocab / tp, rel=1e-9)
    assert layer.ops == profile.params["layer"].tensors


def test_a_power_capped_plan_is_priced_with_its_gemms_at_the_clock_the_cap_sustains():
    """The stated model (docs/cost-model.md, "Power limits"): under a cap only the matrix
    products slow, by the clock share (power limit / board power)^(1/3). So a capped plan's
    step is the full-power plan's with its GEMMs' share of peak lowered by that share, and
    slower than the full-power step by less than 1/share (memory, links and bubble stay)."""
    share = (500 / 700) ** (1 / 3)
    base = _plan(num_gpus=8, tp=2, dp=4, zero=1)

    def with_hardware(**kw):
        return dataclasses.replace(base, hardware=dataclasses.replace(base.hardware, **kw))

    capped = with_hardware(power_limit=500.0)
    lowered = with_hardware(achievable_fraction=base.hardware.achievable_fraction * share)
    full, at_cap, at_lower_share = (estimate(p).step_time_s for p in (base, capped, lowered))
    assert at_cap == pytest.approx(at_lower_share)
    assert full < at_cap < full / share
