"""`ptc calibrate`: a well-formed hardware profile from the plan's own processes, quickly.

Probe times and collective sizes are kept tiny; what is checked is the
file's form and that a plan takes it, never a timing.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from ckpt_helpers import ckpt_plan
from hf_helpers import HFCase, hf_plan

from ptc.cli import main
from ptc.compiler.search.estimate import estimate
from ptc.dsl import load_plan
from ptc.hwprofile import Power, load_profile, write_profile
from ptc.lower.driver import compile_plan
from ptc.models import build_model
from ptc.plan import MoESpec
from ptc.runtime.calibrate import PowerMeter, RoutingRun, Settings, calibrate
from ptc.worker import MODELS

QUICK = Settings(seconds=0.02, rounds=2, min_size=4096, max_size=16384, iters=2, warmup=1)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_calibrate_measures_every_rate_and_the_dp_link(tmp_path):
    plan = ckpt_plan(dp=2, zero=1)
    profile = calibrate(plan, QUICK, build=build_model)
    assert profile.device == "cpu"
    rate = profile.gemm_flops[plan.train.compute_dtype]
    for value in (rate, profile.mem_bandwidth, profile.dispatch_overhead):
        assert math.isfinite(value) and value > 0
    assert set(profile.links) == {"intra"}  # one node: the dp axis uses the intra link
    assert profile.links["intra"].bandwidth > 0 and profile.links["intra"].latency >= 0
    axes = profile.info["axes"]
    assert list(axes) == ["dp"] and axes["dp"]["ranks"] == 2 and axes["dp"]["link"] == "intra"
    # all four operations at 4, 16 KiB
    assert len(axes["dp"]["measured"]) == 4 * 2
    assert profile.info["world_size"] == 2
    for probe in ("dispatch", "memory", "gemm"):
        assert profile.info["probes"][probe]["ops"] > 0
    # A CPU has no power limit: the profile says so and leaves the plan's limit alone.
    assert profile.power == Power(unmeasured="a CPU has no power limit")
    assert "power_limit" not in profile.overrides()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_an_ep_plans_routing_imbalance_is_measured_and_priced(tmp_path):
    """Routers frozen at zero send every row to experts 0 and 1, which ep rank 0 of 2 holds:
    the busiest rank receives all rows, twice the mean, in every dispatch of both steps. A
    plan naming the profile prices that (its all-to-alls carry twice the rows); one whose
    `moe.imbalance` says otherwise keeps its own; a plan without ep measures nothing."""
    plan = hf_plan(HFCase("mixtral_one_sided", dp=2, ep=2))
    profile = calibrate(plan, QUICK, build=build_model,
                        routing=RoutingRun(compiler=compile_plan, models=MODELS))
    assert (profile.routing.imbalance, profile.routing.ep, profile.routing.steps) == (2.0, 2, 2)
    write_profile(profile, tmp_path / "hw.json")
    assert load_profile(tmp_path / "hw.json").routing == profile.routing
    named = dataclasses.replace(plan, hardware=dataclasses.replace(
        plan.hardware, profile=str(tmp_path / "hw.json")))
    even = dataclasses.replace(named, moe=MoESpec(imbalance=1.0))
    assert (named.routing_imbalance, even.routing_imbalance) == (2.0, 1.0)
    measured, assumed = estimate(named).breakdown, estimate(even).breakdown
    assert measured["ep_comm"] == pytest.approx(2 * assumed["ep_comm"], rel=1e-12)
    assert measured["compute"] > assumed["compute"]  # the busiest rank's experts, waited for
    assert calibrate(hf_plan(HFCase("mixtral", dp=2)), QUICK, build=build_model,
                     routing=RoutingRun(compiler=compile_plan, models=MODELS)).routing is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpus_power_limit_and_sustained_clock_are_read_or_said_unreadable():
    """With NVML (nvidia-ml-py) the meter reads the enforced limit and the SM clock after a
    GEMM; without it, the reading says why instead of guessing."""
    device = torch.device("cuda", torch.cuda.current_device())
    meter = PowerMeter(device)
    x = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    for _ in range(20):
        x = x @ x.T / 64
    torch.cuda.synchronize(device)
    meter.sample()
    reading = meter.reading()
    if reading.limit is None:
        assert "nvidia-ml-py" in reading.unmeasured
    else:
        assert reading.limit > 0 and reading.sm_clock > 0 and not reading.unmeasured


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_the_command_writes_a_profile_a_plan_takes(tmp_path, capsys):
    """The profile is written where -o says; the line after names it as the plan's folder
    reaches it, and a plan that names it so takes its figures."""
    plan_path = tmp_path / "plans" / "plan.ptc"
    plan_path.parent.mkdir()
    plan_path.write_text(PLAN)
    out = tmp_path / "hw.json"
    assert main(["calibrate", str(plan_path), "-o", str(out), "--seconds", "0.02", "--rounds", "1",
                 "--min-size", "4K", "--max-size", "4K", "--iters", "1", "--warmup", "1"]) == 0
    printed = capsys.readouterr().out
    assert "dispatch" in printed and f"wrote {out}; the plan takes its figures with hardware " \
        '{ profile = "../hw.json" }' in printed
    data = json.loads(out.read_text())
    assert data["ptc_hardware_profile"] == 1 and data["device"] == "cpu"
    profile = load_profile(out)
    with_profile = load_plan(plan_path, overrides={"hardware.profile": str(out)})
    assert with_profile.hardware.gemm_rate("fp32") == profile.gemm_flops["fp32"]
    assert with_profile.hardware.mem_bandwidth == profile.mem_bandwidth
    assert with_profile.hardware.dispatch_overhead == profile.dispatch_overhead
    named = plan_path.parent / "named.ptc"  # the line as printed, in a plan beside this one
    named.write_text(PLAN.replace("hardware {", 'hardware {\n  profile = "../hw.json"', 1))
    assert load_plan(named).hardware.gemm_rate("fp32") == profile.gemm_flops["fp32"]


PLAN = """\
model gpt {
  layers = 1
  hidden = 16
  heads = 2
  vocab = 32
  max_seq = 8
}
hardware {
  gpu = cpu
  gpus_per_node = 1
}
train {
  seq_len = 8
  global_batch = 1
  dtype = fp32
}
"""
