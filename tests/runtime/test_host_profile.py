"""`ptc run` of a CPU plan that names no hardware profile prices it with this host's profile
(`ptc.runtime.host_profile`): measured once with the plan's processes, kept in the cache
under the host's fingerprint and the ranks a node runs, read by every later run.

The measurement itself is `ptc calibrate`'s (tests/distributed/test_calibrate.py); here a
stand-in profile counts the measurements and shows which figures the plan gets. The rest
of the suite runs with PTC_HOST_PROFILE=off (tests/conftest.py): its CPU plans are priced
with the preset's figures, the same on any machine.
"""

from __future__ import annotations

import dataclasses

import pytest

import ptc.cli
from ptc.dsl import load_plan
from ptc.hwprofile import HardwareProfile, Link, Power
from ptc.runtime import calibrate as calibrate_module
from ptc.runtime import host_profile
from ptc.runtime.host_profile import applies, host_profile_path, with_host_profile

PLAN = """\
model gpt {
  layers = 2
  hidden = 32
  heads = 2
  vocab = 64
  max_seq = 16
}
hardware {
  gpu = cpu
  gpus_per_node = 2
  dispatch_overhead = 9 us
}
parallel { dp = 2 }
train {
  seq_len = 16
  global_batch = 2
}
"""
MEASURED = HardwareProfile(device="cpu", gemm_flops={"fp32": 7e9}, mem_bandwidth=3e9,
                           dispatch_overhead=20e-6,
                           links={"intra": Link(bandwidth=1e9, latency=1e-3)},
                           power=Power(limit=None, sm_clock=None, unmeasured="a CPU"))


@pytest.fixture()
def plan(tmp_path, monkeypatch):
    monkeypatch.setenv("PTC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(host_profile.SWITCH, raising=False)
    (tmp_path / "plan.ptc").write_text(PLAN)
    return load_plan(tmp_path / "plan.ptc")


def test_only_a_cpu_plan_without_a_profile_of_its_own_takes_the_hosts(plan, monkeypatch,
                                                                       tmp_path):
    assert applies(plan)
    gpu = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware, gpu="H100-SXM"))
    assert not applies(gpu)
    own = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware,
                                                                 profile="hw.json"))
    assert not applies(own)
    monkeypatch.setenv(host_profile.SWITCH, "off")
    assert not applies(plan)


def test_the_cache_key_is_the_host_and_the_ranks_sharing_it(plan, tmp_path):
    path = host_profile_path(plan)
    assert path == host_profile_path(plan) and path.parent.name == "hosts"
    more = load_plan(tmp_path / "plan.ptc", overrides={
        "hardware.gpus_per_node": "4", "parallel.dp": "4", "train.global_batch": "4"})
    assert host_profile_path(more) != path


def test_measured_once_by_a_run_then_read_and_the_plans_own_keys_stay(plan, monkeypatch):
    measured = []

    def measure(plan_, settings=None, *, build):
        measured.append(plan_.num_gpus)
        return MEASURED

    monkeypatch.setattr(calibrate_module, "calibrate", measure)
    # ptc explain, plan and report read a measurement a run made, and never measure
    assert ptc.cli._priced_on_this_host(plan, measure=False) == plan
    first = ptc.cli._priced_on_this_host(plan)
    second = ptc.cli._priced_on_this_host(plan)
    assert measured == [2]  # the plan's processes, once
    assert first.hardware == second.hardware
    hw = first.hardware
    assert hw.profile == str(host_profile_path(plan))
    assert hw.gemm_flops == {"fp32": 7e9} and hw.mem_bandwidth == 3e9
    assert (hw.intra.bandwidth, hw.intra.latency) == (1e9, 1e-3)
    assert hw.dispatch_overhead == pytest.approx(9e-6)  # written in the plan: the plan's
    assert with_host_profile(plan, host_profile_path(plan)).hardware == hw
    assert ptc.cli._priced_on_this_host(plan, measure=False).hardware == hw
    assert measured == [2]
