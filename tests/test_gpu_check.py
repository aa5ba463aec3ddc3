"""`bench/gpu_check.py` keeps working on a CPU machine, and its comparisons compare.

The script is meant for rare, short GPU slots; this test runs it the way a
slot would (a separate process, `--quick`), with CUDA hidden, and reads its
JSON: every check present and none errored, the losses of ptc and eager
PyTorch equal within the script's tolerance (recomputed here from the
recorded losses, not taken from the script's verdict), the trained weights
close, finite speeds, and the multi-GPU part skipped for lack of GPUs. Then
it shows that the comparison can fail: the script's eager trainer, run here
on the tiny plan with another learning rate, must not match ptc's recorded
losses, while with the plan's own it must; `compare_losses` and
`compare_weights` are held to their stated tolerances directly; and a part
that raises is recorded while the others still run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"
QUICK_STEPS = 3


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = load_script()


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path, even on a GPU machine
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert out.exists(), f"no JSON written (exit {proc.returncode}):\n{proc.stdout[-3000:]}" \
                         f"\n{proc.stderr[-3000:]}"
    data = json.loads(out.read_text())
    data["_returncode"], data["_stdout"] = proc.returncode, proc.stdout
    return data


def checks(data: dict) -> dict[str, dict]:
    return {c["name"]: c for c in data["checks"]}


@pytest.mark.timeout(180)
def test_cpu_run_records_every_check(result):
    got = checks(result)
    assert not result["errors"], result["errors"]
    assert not [n for n, c in got.items() if c["status"] == "error"]
    assert result["_returncode"] == (0 if result["passed"] else 1)
    assert result["env"]["torch"] == torch.__version__
    assert result["env"]["device"] == "cpu" and result["env"]["cuda_devices"] == 0
    for name in ("tiny_gpt.losses.ptc_vs_eager", "llama.losses.ptc_vs_eager",
                 "llama.losses.eager_compiled_vs_eager", "llama.losses.ptc_compiled_vs_eager",
                 "tiny_gpt.weights.ptc_vs_eager", "llama.weights.ptc_vs_eager",
                 "tiny_gpt.memory.state_vs_program", "llama.memory.state_vs_program"):
        assert got[name]["status"] == "pass", got[name]
    for name in ("tiny_gpt.memory.state_vs_estimate", "llama.memory.state_vs_estimate"):
        assert got[name]["status"] in ("pass", "fail"), got[name]  # the cost model's verdict
    for key in ("tiny_gpt", "llama"):
        assert got[f"{key}.memory.peak_vs_estimate"]["status"] == "skip"
    # The multi-GPU part says why it did not run, in the checks, the JSON and the table.
    assert got["multi_gpu"]["status"] == "skip"
    assert result["multi_gpu"]["status"] == "skipped"
    assert "found 0" in result["multi_gpu"]["reason"]
    assert "multi-GPU: skipped: needs 2 or more CUDA devices, found 0" in result["_stdout"]


@pytest.mark.timeout(180)
def test_cpu_run_numbers_are_finite_and_losses_agree(result):
    rows_of = {"tiny_gpt": ("ptc", "eager"),
               "llama": ("ptc", "eager", "eager_compiled", "ptc_compiled")}
    for key, names in rows_of.items():
        run = result["runs"][key]
        assert set(names) <= set(run["rows"]), run["rows"].keys()
        dtype = run["plan"]["dtype"]
        for name in names:
            row = run["rows"][name]
            assert len(row["losses"]) == QUICK_STEPS
            assert all(isinstance(x, float) and math.isfinite(x) for x in row["losses"])
            for field in ("step_s", "tokens_per_s", "mfu"):
                assert isinstance(row[field], float) and 0 < row[field] < math.inf, (key, name)
            assert row["vs_eager"] > 0
        # Recomputed here from the recorded losses: each step within the stated tolerance.
        eager = run["rows"]["eager"]["losses"]
        for name in names[2:] + ("ptc",):
            for step, (ref, other) in enumerate(zip(eager, run["rows"][name]["losses"])):
                assert abs(ref - other) <= gpu_check.loss_tolerance(ref, dtype), (key, name, step)
        assert eager[-1] < eager[0], f"{key}: eager training did not lower the loss: {eager}"
        weights = run["weights"]
        assert 0 <= weights["ratio"] <= gpu_check.WEIGHTS_RTOL, (key, weights)
        held = result["memory"][key]["held"]
        assert all(held[k] > 0 for k in ("params", "grads", "optimizer"))


@pytest.mark.timeout(120)
def test_comparison_detects_a_different_training(result):
    """The script's eager trainer, rerun here: the plan's own settings reproduce ptc's
    recorded losses; another learning rate does not pass the comparison."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plan = gpu_check.tiny_plan(torch.device("cpu"), QUICK_STEPS)
        ptc_losses = result["runs"]["tiny_gpt"]["rows"]["ptc"]["losses"]
        same = gpu_check.run_eager(plan, torch.device("cpu"), 1)
        assert gpu_check.compare_losses(same["losses"], ptc_losses, "fp32")["passed"]
        optimizer = dataclasses.replace(plan.train.optimizer, lr=plan.train.optimizer.lr * 1.5)
        other = dataclasses.replace(plan, train=dataclasses.replace(plan.train,
                                                                     optimizer=optimizer))
        moved = gpu_check.run_eager(other, torch.device("cpu"), 1)
        assert not gpu_check.compare_losses(moved["losses"], ptc_losses, "fp32")["passed"]
    finally:
        torch.set_num_threads(threads)


def test_compare_losses_holds_its_tolerances():
    compare = gpu_check.compare_losses
    ref = [10.4, 9.8, 9.1, 8.3]  # bf16 ulps: 2^-4 at [8, 16)
    ulp = 2.0 ** -4
    assert compare(ref, list(ref), "bf16")["passed"]
    assert compare(ref, [x + 3 * ulp for x in ref], "bf16")["passed"]
    assert not compare(ref, ref[:3] + [ref[3] + 5 * ulp], "bf16")["passed"]
    assert not compare(ref, ref[:3], "bf16")["passed"]
    assert not compare(ref, ref[:3] + [math.nan], "bf16")["passed"]
    assert compare(ref, [x * (1 + 5e-5) for x in ref], "fp32")["passed"]
    assert not compare(ref, [x * (1 + 1e-3) for x in ref], "fp32")["passed"]
    assert gpu_check.bf16_ulp(6.2) == 2.0 ** -5 and gpu_check.bf16_ulp(8.0) == 2.0 ** -4


@pytest.mark.timeout(90)
def test_a_failing_part_is_recorded_and_the_rest_runs(tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    monkeypatch.setattr(gpu_check, "run_ptc", broken)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path, anywhere
    out = tmp_path / "broken.json"
    threads = torch.get_num_threads()
    try:
        code = gpu_check.main(["--quick", "--skip-1b", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    data = json.loads(out.read_text())
    assert code == 1 and data["passed"] is False
    assert [e["part"] for e in data["errors"]] == ["tiny_gpt.ptc"]
    assert data["errors"][0]["error"] == \
        "RuntimeError: CUDA error: an illegal memory access was encountered"
    got = checks(data)
    assert got["tiny_gpt.losses.ptc_vs_eager"]["status"] == "error"
    assert got["tiny_gpt.memory.state_vs_program"]["status"] == "error"
    assert len(data["runs"]["tiny_gpt"]["rows"]["eager"]["losses"]) == QUICK_STEPS  # went on
    assert got["multi_gpu"]["status"] == "skip"
    assert "error in tiny_gpt.ptc: RuntimeError: CUDA error" in capsys.readouterr().out


def test_compare_weights_measures_distance_against_movement():
    initial = {"w": torch.zeros(4)}
    eager = {"w": torch.tensor([1.0, 1.0, 1.0, 1.0])}  # moved by 2
    close = {"w": eager["w"] + torch.tensor([0.05, 0.0, 0.0, 0.0])}
    far = {"w": eager["w"] * 1.2}
    assert gpu_check.compare_weights(close, eager, initial)["passed"]
    assert gpu_check.compare_weights(close, eager, initial)["ratio"] == pytest.approx(0.025)
    assert not gpu_check.compare_weights(far, eager, initial)["passed"]
    assert not gpu_check.compare_weights({}, eager, initial)["passed"]
