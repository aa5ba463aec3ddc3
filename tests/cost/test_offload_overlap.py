"""The offloaded optimizer step is priced as the pipeline the runtime runs.

`offloaded_step` prices three resources in a row — the gradient copy down,
the CPU step, the weights' copy up — each unit through all three in order
(`ptc.runtime.offload`). Checked here against what that pipeline gives by
hand in its three regimes, and at ZeRO-3 the tail hidden by the next forward.
Per element, with a host link of B bytes/s, N ranks per node and the CPU's
rate R: down 4/B, CPU N/R, up w/B (w: bytes of the weights sent).
"""

from __future__ import annotations

import dataclasses

import pytest

from ptc.compiler.cost.step import CPU_ADAM_ELEMENTS_PER_S, _stage_units, offloaded_step
from ptc.compiler.search.estimate import estimate
from ptc.compiler.profile.cache import model_profile
from ptc.compiler.shapes import plan_from_shape
from ptc.plan import HardwareSpec

R = CPU_ADAM_ELEMENTS_PER_S


def hardware(link: float, ranks: int = 1) -> HardwareSpec:
    return HardwareSpec.preset("H100-SXM", gpus_per_node=ranks, host_bandwidth=link)


def test_one_unit_hides_nothing():
    hw = hardware(64e9)
    t = offloaded_step([1e6], hw, weight_bytes=4)
    assert t.exposed == pytest.approx(1e6 * (4 / 64e9 + 1 / R + 4 / 64e9))
    assert t.hidden == pytest.approx(0.0, abs=1e-15)


def test_when_the_cpu_is_slowest_only_the_first_and_last_copies_show():
    hw, n, x = hardware(64e9, ranks=8), 10, 1e6
    d, c, u = x * 4 / 64e9, x * 8 / R, x * 2 / 64e9
    t = offloaded_step([x] * n, hw, weight_bytes=2)
    assert t.exposed == pytest.approx(d + n * c + u)
    assert t.hidden == pytest.approx((n - 1) * (d + u))


def test_when_the_link_is_slowest_the_downward_copies_set_the_pace():
    # 0.5 GB/s: 8 ns an element down and up, against 1.4 ns of CPU
    hw, n, x = hardware(0.5e9), 6, 1e6
    d, c, u = x * 4 / 0.5e9, x / R, x * 4 / 0.5e9
    t = offloaded_step([x] * n, hw, weight_bytes=4)
    # Unit k's weights leave when its step is done, k·d + c, and take u = d each.
    assert t.exposed == pytest.approx(n * d + c + u)
    assert t.hidden == pytest.approx(n * (d + c + u) - t.exposed)


def test_uneven_units_follow_the_recurrence():
    hw = hardware(1e9)
    units = [3e6, 1e6, 2e6]
    d, c, u = ([x * 4 / 1e9 for x in units], [x / R for x in units], [x * 2 / 1e9 for x in units])
    down = [sum(d[:k + 1]) for k in range(3)]
    cpu, up = [], []
    for k in range(3):
        cpu.append(max(cpu[-1] if cpu else 0.0, down[k]) + c[k])
        up.append(max(up[-1] if up else 0.0, cpu[k]) + u[k])
    t = offloaded_step(units, hw, weight_bytes=2)
    assert t.exposed == pytest.approx(up[-1])
    assert t.exposed + t.hidden == pytest.approx(sum(d) + sum(c) + sum(u))


def test_zero3_hides_the_last_weights_behind_the_next_forward():
    hw, n, x = hardware(0.5e9), 4, 1e6
    plain = offloaded_step([x] * n, hw, weight_bytes=4)
    cpu_done = n * x * 4 / 0.5e9 + x / R  # the last step ends after the last gradient
    tail = plain.exposed - cpu_done
    assert tail > 0
    assert offloaded_step([x] * n, hw, weight_bytes=4, behind=1.0).exposed == \
        pytest.approx(cpu_done)
    assert offloaded_step([x] * n, hw, weight_bytes=4, behind=tail / 4).exposed == \
        pytest.approx(cpu_done + 3 * tail / 4)


def test_the_estimate_saves_what_the_pipeline_hides():
    """pp2 ZeRO-1 bf16: the optimizer part is the slowest stage's pipelined step; exposed and
    hidden add up to its three parts one after the other; the hidden part is reported, not
    counted in the step."""
    plan = plan_from_shape(family="gpt", layers=8, hidden=1024, heads=8, vocab=32000,
                           seq_len=512, global_batch=32, gpu="A100-80GB", num_gpus=8, tp=1,
                           pp=2, dp=4, zero=1, dtype="bf16")
    plan = dataclasses.replace(plan, parallel=dataclasses.replace(plan.parallel,
                                                                  offload="optimizer"))
    est = estimate(plan)
    profile = model_profile(plan.model, "bf16")
    hw = plan.hardware
    stages = [offloaded_step([u / 4 for u in _stage_units(profile, est.layout, i)], hw,
                             weight_bytes=2) for i in range(2)]
    slowest = max(stages, key=lambda t: t.exposed)
    assert est.breakdown["optimizer"] == pytest.approx(slowest.exposed)
    assert est.hidden["optimizer"] == pytest.approx(slowest.hidden)
    serial = max(sum(_stage_units(profile, est.layout, i)) / 4
                 * ((4 + 2) / hw.host_bandwidth + hw.gpus_per_node / R) for i in range(2))
    assert slowest.exposed + slowest.hidden == pytest.approx(serial)
    assert 0 < est.hidden["optimizer"] and est.breakdown["optimizer"] < serial
    assert est.step_time_s == pytest.approx(sum(est.breakdown.values()))
