"""Compute beside a hidden collective runs on the SMs its kernels leave: each second of tp,
pp or dp communication the runtime hides behind compute adds comm_multiprocessors /
multiprocessors of a second to the step (`StepCost` part "contention"). Expected values
are the estimate's own hidden seconds times that share, so a change in what is hidden
moves both sides; the share itself is checked against the preset's figures."""

from __future__ import annotations

import dataclasses

import pytest

from ptc.compiler.search.estimate import estimate
from ptc.compiler.shapes import plan_from_shape
from ptc.errors import PlanError
from ptc.plan import HardwareSpec
from ptc.presets import NCCL_BLOCKS, PRESETS


def _plan(gpu: str = "H100-SXM", **hardware):
    """A 1B-parameter Llama on 16 GPUs whose tp, pp and ZeRO-3 traffic all overlap compute,
    its 16 layers cut 8 / 8 (the balanced cut may move with the contention term)."""
    plan = plan_from_shape(family="llama", layers=16, hidden=2048, heads=16, kv_heads=8,
                           ffn=8192, vocab=32000, seq_len=4096, global_batch=32, gpu=gpu,
                           num_gpus=16, tp=2, pp=2, micro_batch=1, dtype="bf16", zero=3,
                           sequence_parallel=True, tp_comm="async", checkpoint="none",
                           overlap=True)
    plan = dataclasses.replace(plan, parallel=dataclasses.replace(
        plan.parallel, first_stage_layers=8, last_stage_layers=8))
    if hardware:
        plan = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware, **hardware))
    return plan


def test_each_hidden_second_costs_the_share_of_sms_the_collectives_hold() -> None:
    est = estimate(_plan())
    hidden = {kind: est.hidden.get(kind, 0.0) for kind in ("tp_comm", "pp_comm", "dp_comm")}
    assert all(seconds > 0 for seconds in hidden.values()), hidden
    share = NCCL_BLOCKS / PRESETS["H100-SXM"].multiprocessors  # 24 of 132 SMs
    assert est.breakdown["contention"] == pytest.approx(share * sum(hidden.values()), rel=1e-12)
    assert est.step_time_s == pytest.approx(sum(est.breakdown.values()), rel=1e-12)


def test_without_sms_held_the_step_is_shorter_by_exactly_the_contention() -> None:
    held, free = estimate(_plan()), estimate(_plan(comm_multiprocessors=0))
    assert free.breakdown["contention"] == 0.0
    assert {k: v for k, v in free.breakdown.items() if k != "contention"} == pytest.approx(
        {k: v for k, v in held.breakdown.items() if k != "contention"}, rel=1e-12)
    assert held.step_time_s - free.step_time_s == pytest.approx(held.breakdown["contention"])


def test_more_sms_per_gpu_leave_a_smaller_share_to_communication() -> None:
    h100, b200 = estimate(_plan("H100-SXM")), estimate(_plan("B200"))
    share = {name: est.breakdown["contention"] / sum(
        est.hidden.get(k, 0.0) for k in ("tp_comm", "pp_comm", "dp_comm"))
        for name, est in (("H100-SXM", h100), ("B200", b200))}
    assert share["H100-SXM"] == pytest.approx(24 / 132)
    assert share["B200"] == pytest.approx(24 / 148)


def test_a_cpu_has_no_contention_term() -> None:
    assert HardwareSpec.preset("cpu").contention == 0.0


def test_a_collective_cannot_hold_every_sm() -> None:
    with pytest.raises(PlanError, match="comm_multiprocessors \\(132\\) must be fewer than the "
                                        "GPU's multiprocessors \\(132\\)"):
        HardwareSpec.preset("H100-SXM", comm_multiprocessors=132)
