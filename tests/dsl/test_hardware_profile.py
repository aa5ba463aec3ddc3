"""`hardware { profile = "hw.json" }`: a calibration file's figures in a plan, and its errors.

The file is read from the plan file's folder; its figures replace the
preset's, keys written in the section replace the profile's; a bad file is
one error at the key's value (file, line, column), before anything runs.
"""

from __future__ import annotations

import json

import pytest

from ptc.dsl import dump_plan, load_plan, parse
from ptc.errors import PlanError
from ptc.hwprofile import (
    HardwareProfile,
    Link,
    Power,
    ProfileError,
    load_profile,
    write_profile,
)
from ptc.plan import HardwareSpec, LinkSpec

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
  profile = "hw.json"
}
parallel { dp = 2 }
train {
  seq_len = 16
  global_batch = 4
  dtype = fp32
}
"""

PROFILE = HardwareProfile(
    device="cpu", gemm_flops={"fp32": 4.5e10}, mem_bandwidth=7.5e9, dispatch_overhead=9e-6,
    links={"intra": Link(bandwidth=6e8, latency=1.25e-3)},
    power=Power(unmeasured="a CPU has no power limit"),
    info={"world_size": 2, "device_name": "x86_64", "axes": {"dp": {"ranks": 2}}})

GPU_PLAN = PLAN.replace("gpu = cpu", 'gpu = "H100-SXM"').replace("dtype = fp32", "dtype = bf16")

CAPPED = HardwareProfile(
    device="cuda", gemm_flops={"bf16": 4.2e14}, mem_bandwidth=2.9e12, dispatch_overhead=0.0,
    power=Power(limit=500.0, sm_clock=1455.0), info={"device_name": "NVIDIA H100 80GB HBM3"})


def write(folder, plan: str = PLAN, profile: HardwareProfile | dict | str = PROFILE,
          name: str = "hw.json"):
    (folder / "plan.ptc").write_text(plan)
    path = folder / name
    if isinstance(profile, HardwareProfile):
        write_profile(profile, path)
    elif isinstance(profile, dict):
        path.write_text(json.dumps(profile))
    else:
        path.write_text(profile)
    return folder / "plan.ptc"


def test_a_profile_round_trips_through_its_file(tmp_path):
    write_profile(PROFILE, tmp_path / "p.json")
    back = load_profile(tmp_path / "p.json")
    assert back == PROFILE


def test_the_profiles_figures_replace_the_presets(tmp_path):
    hw = load_plan(write(tmp_path)).hardware
    preset = HardwareSpec.preset("cpu", gpus_per_node=2)
    assert hw.gemm_flops == {"fp32": 4.5e10} and hw.gemm_rate("fp32") == 4.5e10
    assert hw.mem_bandwidth == 7.5e9 and hw.dispatch_overhead == 9e-6
    assert hw.intra == LinkSpec(bandwidth=6e8, latency=1.25e-3)
    assert hw.inter == preset.inter  # no axis measured it: the preset's stays
    assert hw.peak_flops == preset.peak_flops and hw.hbm_bytes == preset.hbm_bytes
    assert hw.profile == str(tmp_path / "hw.json")


def test_keys_written_in_the_section_replace_the_profiles(tmp_path):
    text = PLAN.replace('  profile = "hw.json"\n', '  profile = "hw.json"\n'
                        '  mem_bandwidth = 3 GB/s\n  dispatch_overhead = 2 us\n')
    hw = load_plan(write(tmp_path, text)).hardware
    assert hw.mem_bandwidth == 3e9 and hw.dispatch_overhead == pytest.approx(2e-6)
    assert hw.gemm_flops == {"fp32": 4.5e10}


def test_the_path_is_read_from_the_plans_folder(tmp_path, monkeypatch):
    sub = tmp_path / "plans"
    sub.mkdir()
    path = write(sub)
    monkeypatch.chdir(tmp_path)  # not the plan's folder
    assert load_plan(path).hardware.mem_bandwidth == 7.5e9
    # Given on the command line, it is read from the working directory.
    write_profile(PROFILE, tmp_path / "other.json")
    plan = load_plan(path, overrides={"hardware.profile": "other.json"})
    assert plan.hardware.profile == "other.json"


def test_dump_writes_the_profile_not_its_figures(tmp_path):
    plan = load_plan(write(tmp_path))
    text = dump_plan(plan)
    assert f'profile = "{tmp_path / "hw.json"}"' in text
    assert "mem_bandwidth" not in text and "intra" not in text and "gemm" not in text
    assert parse(text, file=str(tmp_path / "dumped.ptc")) == plan


def test_a_cpu_profile_says_why_it_has_no_power_limit(tmp_path):
    write_profile(PROFILE, tmp_path / "p.json")
    assert json.loads((tmp_path / "p.json").read_text())["power"] == {
        "limit": None, "sm_clock": None, "unmeasured": "a CPU has no power limit"}
    assert load_plan(write(tmp_path)).hardware.power_limit is None


def test_a_capped_gpus_profile_describes_the_capped_part(tmp_path):
    """The limit the profile was measured under becomes the plan's; its measured GEMM rate is
    that limit's already, and a rate it did not measure is priced at the clock it leaves."""
    hw = load_plan(write(tmp_path, GPU_PLAN, CAPPED)).hardware
    assert load_profile(tmp_path / "hw.json") == CAPPED
    assert hw.power_limit == 500.0 and hw.gemm_rate("bf16") == 4.2e14
    assert hw.gemm_rate("fp16") == pytest.approx(
        989e12 * hw.achievable_fraction * (500 / 700) ** (1 / 3))


def test_a_plan_cannot_price_another_limit_than_its_profile_was_measured_under(tmp_path):
    text = GPU_PLAN.replace('  profile = "hw.json"\n', '  profile = "hw.json"\n'
                            "  power_limit = 600 W\n")
    path = write(tmp_path, text, CAPPED)
    with pytest.raises(PlanError) as info:
        load_plan(path)
    (d,) = info.value.diagnostics
    assert d.field == "hardware.power_limit" and (d.span.line, d.span.column) == (12, 17)
    assert d.message == ("power_limit = 600 W, but hardware profile hw.json was measured under "
                         "500 W, the limit its rates hold at; calibrate under 600 W")


def test_gemm_and_dispatch_overhead_are_plan_keys(tmp_path):
    text = PLAN.replace('  profile = "hw.json"\n',
                        "  gemm = flops(fp32 = 50 GFLOP/s)\n  dispatch_overhead = 5 us\n")
    plan = parse(text)
    assert plan.hardware.gemm_rate("fp32") == 5e10
    assert plan.hardware.dispatch_overhead == pytest.approx(5e-6)
    assert parse(dump_plan(plan)) == plan


def _error(tmp_path, profile, **kw) -> str:
    path = write(tmp_path, profile=profile, **kw)
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert len(info.value.diagnostics) == 1
    return info.value.diagnostics[0].render().splitlines()[0]


GOOD = PROFILE.to_json()


@pytest.mark.parametrize("profile,message", [
    ("{", "hardware profile hw.json: not JSON: Expecting property name enclosed in double "
          "quotes at line 1 column 2"),
    ("[1, 2]", "hardware profile hw.json: must hold a JSON object, found list"),
    ({**GOOD, "ptc_hardware_profile": 7}, 'hardware profile hw.json: not a ptc hardware '
     'profile: "ptc_hardware_profile" must be 1, found 7'),
    ({**GOOD, "mem_bandwidth": -1}, 'hardware profile hw.json: "mem_bandwidth" must be > 0, '
     "found -1"),
    ({**GOOD, "gemm_flops": {"fp64": 1e9}}, 'hardware profile hw.json: "gemm_flops" names '
     "unknown compute dtype 'fp64'"),
    ({**GOOD, "intra": {"bandwidth": 1e9}}, 'hardware profile hw.json: "intra.latency" must '
     "be a finite number, found None"),
    ({**GOOD, "device": "cuda"}, "hardware profile hw.json was measured on a GPU, but gpu is "
     "cpu; calibrate on the plan's device"),
    ({**GOOD, "power": {"limit": None, "sm_clock": None}}, 'hardware profile hw.json: "power" '
     'without limit or sm_clock must say why in "unmeasured"'),
    ({**GOOD, "power": {"limit": -5, "sm_clock": 1400}}, 'hardware profile hw.json: '
     '"power.limit" must be > 0, found -5'),
    ({**GOOD, "routing": {"imbalance": 0.5, "ep": 2, "steps": 2}}, 'hardware profile '
     'hw.json: "routing.imbalance" must be >= 1, found 0.5'),
    ({**GOOD, "routing": {"imbalance": 1.2, "ep": 0, "steps": 2}}, 'hardware profile '
     'hw.json: "routing.ep" must be a positive integer, found 0'),
])
def test_a_bad_profile_is_one_error_at_the_key(tmp_path, profile, message):
    first = _error(tmp_path, profile)
    plan = tmp_path / "plan.ptc"
    assert first.startswith(f"{plan}:11:13: error: {message}"), first
    assert first.endswith("[hardware.profile]")


def test_a_missing_profile_says_how_to_make_one(tmp_path):
    first = _error(tmp_path, PROFILE, name="elsewhere.json")
    assert first == (f"{tmp_path / 'plan.ptc'}:11:13: error: hardware profile hw.json: no such "
                     "file (write one with `ptc calibrate PLAN -o FILE`) [hardware.profile]")


def test_a_bad_profile_given_on_the_command_line_names_the_flag(tmp_path):
    path = write(tmp_path)
    with pytest.raises(PlanError) as info:
        load_plan(path, overrides={"hardware.profile": str(tmp_path / "none.json")})
    assert str(info.value).startswith("--hardware.profile: error: hardware profile ")


def test_python_plans_take_a_profile_too(tmp_path):
    write_profile(PROFILE, tmp_path / "hw.json")
    hw = HardwareSpec.preset("cpu", profile=str(tmp_path / "hw.json"))
    assert hw.mem_bandwidth == 7.5e9 and hw.dispatch_overhead == 9e-6
    with pytest.raises(ProfileError, match="no such file"):
        HardwareSpec.preset("cpu", profile=str(tmp_path / "none.json"))
