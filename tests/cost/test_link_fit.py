"""Links fitted to measured collectives, and the once-a-step collectives the runtime adds."""

from __future__ import annotations

import dataclasses

import pytest

from ptc.compiler.cost.collectives import all_gather, all_reduce
from ptc.compiler.search.estimate import estimate
from ptc.compiler.profile.cache import model_profile
from ptc.compiler.cost.linkfit import OPS, Measurement, fit_links, predict
from ptc.compiler.shapes import plan_from_shape
from ptc.compiler.cost.topology import AxisGroup
from ptc.plan import HardwareSpec, LinkSpec

pytestmark = pytest.mark.timeout(120)


def ring_all_gather(size: float, n: int, link: LinkSpec) -> float:
    """n - 1 steps, each a latency and 1/n of the output over the link (by hand)."""
    return (n - 1) * (link.latency + size / n / link.bandwidth)


def test_a_fit_recovers_the_links_that_made_the_times():
    hw = HardwareSpec.preset("cpu", nodes=2, gpus_per_node=4)
    truth = {"intra": LinkSpec(bandwidth=3e8, latency=1.2e-3),
             "inter": LinkSpec(bandwidth=1e8, latency=3e-3)}
    made = dataclasses.replace(hw, **truth)
    groups = [AxisGroup("dp", 4, 1, 4), AxisGroup("pp", 2, 4, 1), AxisGroup("tp", 8, 1, 4)]
    measured = []
    for group in groups:
        for op in OPS:
            for size in (4096, 2**16, 2**20, 2**24):
                m = Measurement(op, size, group, 1.0)
                measured.append(dataclasses.replace(m, seconds=predict(m, made)))
    fit = fit_links(measured, hw)
    for name, link in truth.items():
        assert fit.links[name].latency == pytest.approx(link.latency, rel=1e-6)
        assert fit.links[name].bandwidth == pytest.approx(link.bandwidth, rel=1e-6)
    assert fit.max_error < 1e-6


def test_only_the_links_measured_are_fitted():
    hw = HardwareSpec.preset("cpu", gpus_per_node=4)
    group = AxisGroup("dp", 4, 1, 4)
    link = LinkSpec(bandwidth=5e8, latency=2e-3)
    measured = [Measurement("all_gather", size, group, ring_all_gather(size, 4, link))
                for size in (4096, 2**18, 2**22)]
    fit = fit_links(measured, hw)
    assert set(fit.links) == {"intra"}
    assert fit.links["intra"].latency == pytest.approx(2e-3, rel=1e-6)
    assert fit.links["intra"].bandwidth == pytest.approx(5e8, rel=1e-6)


def test_a_step_pays_for_the_guard_the_norm_and_each_units_gather():
    """ZeRO-1 on dp = 4, one node: the guard's all-reduce over all 4 ranks (a flag each, the
    loss and the squared norm), and the weights gathered unit by unit (embedding, 2 layers,
    final norm and head) rather than at once."""
    plan = plan_from_shape(family="gpt", layers=2, hidden=64, heads=4, vocab=128, seq_len=32,
                           global_batch=8, gpu="cpu", num_gpus=4, dp=4, zero=1, dtype="fp32")
    hw, group = plan.hardware, AxisGroup("grad", 4, 1, 4)
    est = estimate(plan)
    pr = model_profile(plan.model, "fp32").params
    units = [pr["pre"].total, pr["layer"].total, pr["layer"].total, pr["post"].total]
    expected = all_reduce(4 * 6, group, hw).seconds \
        + sum(all_gather(4 * n, group, hw).seconds for n in units) \
        - all_gather(4 * sum(units), group, hw).seconds
    assert est.breakdown["step_sync"] == pytest.approx(expected)
    # A ring all-gather of 4 ranks pays 3 latencies: the three extra units' gathers add 9.
    link = hw.intra
    assert est.breakdown["step_sync"] > 9 * link.latency


def test_pure_data_parallel_zero0_folds_the_guard_into_the_gradient_all_reduce():
    """ZeRO-0 on dp = 4 with fp32 gradients: the guard rides the gradient all-reduce
    (`FoldedGuard`), so the step has no collective of its own left; with bf16 gradients, or
    with tp, it keeps its own all-reduce over every rank."""
    kw = dict(family="gpt", layers=2, hidden=64, heads=4, vocab=128, seq_len=32,
              global_batch=8, gpu="cpu", num_gpus=4, zero=0, dtype="bf16")
    folded = plan_from_shape(dp=4, **kw)
    assert folded.train.grad_dtype == "fp32"
    assert estimate(folded).breakdown["step_sync"] == 0
    hw, world = HardwareSpec.preset("cpu"), AxisGroup("world", 4, 1, 4)
    bf16_grads = dataclasses.replace(folded, train=dataclasses.replace(folded.train,
                                                                       grad_dtype="bf16"))
    assert estimate(bf16_grads).breakdown["step_sync"] == pytest.approx(
        all_reduce(4 * 6, world, hw).seconds)
    tp2 = estimate(plan_from_shape(dp=2, tp=2, **kw)).breakdown["step_sync"]
    assert tp2 == pytest.approx(all_reduce(4 * 6, world, hw).seconds)


def test_on_a_cpu_communication_hides_behind_nothing():
    kw = dict(family="gpt", layers=2, hidden=64, heads=4, vocab=128, seq_len=32, global_batch=8,
              num_gpus=4, dp=4, zero=0, dtype="fp32")
    cpu = estimate(plan_from_shape(gpu="cpu", overlap=True, **kw))
    cpu_off = estimate(plan_from_shape(gpu="cpu", overlap=False, **kw))
    assert cpu_off.breakdown["dp_comm"] > 0
    assert cpu.breakdown["dp_comm"] == pytest.approx(cpu_off.breakdown["dp_comm"])
