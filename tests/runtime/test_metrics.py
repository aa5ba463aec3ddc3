"""Rank 0's step report: the line, the JSONL file, TensorBoard, W&B, the predicted-time hook."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from runtime_helpers import tiny_plan

from ptc.lower.resolve import resolve
from ptc.lower.driver import capture_plan, compile_plan
from ptc.runtime.executor import StepStats
from ptc.runtime.metrics import (SCALARS, WANDB_RUN_ID, StepReporter, format_step, plan_config,
                                 stragglers)

pytestmark = pytest.mark.timeout(30)


def stats(step: int) -> StepStats:
    return StepStats(step=step, loss=4.25, lr=1e-3, grad_norm=0.5, step_time=0.2, tokens=4096,
                     comm_wait=0.05)


def test_line_has_step_loss_time_and_throughput():
    line = format_step(stats(3), 20, None)
    assert line == "step 3/20  loss 4.2500  lr 0.001  |g| 0.5  200.0 ms  20,480 tok/s"
    assert format_step(stats(3), 20, 0.15).endswith("(predicted 150.0 ms)")


def test_jsonl_gets_every_step_and_lines_follow_log_every(tmp_path):
    plan = tiny_plan("gpt", zero=0, dp=1, accum=1, metrics=str(tmp_path / "m" / "metrics.jsonl"))
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with StepReporter(plan, steps=3, enabled=True, predicted_step_time=None,
                      console=console) as reporter:
        for k in (1, 2, 3):
            reporter.report(stats(k))
    text = (tmp_path / "m" / "metrics.jsonl").read_text()
    records = [json.loads(line) for line in text.splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    health = {k: records[0].pop(k)
              for k in ("mfu", "peak_memory_bytes", "nonfinite", "restart", "time")}
    assert records[0] == {"step": 1, "loss": 4.25, "lr": 1e-3, "grad_norm": 0.5, "step_time": 0.2,
                          "exposed_comm_s": 0.05, "tokens_per_s": 20480.0,
                          "predicted_step_time": None, "slowest_rank": None, "work_skew": None}
    assert health["mfu"] is None and health["peak_memory_bytes"] > 0
    assert health["nonfinite"] == [] and health["restart"] == 0
    assert health["time"] <= records[1]["time"] <= records[2]["time"]
    assert out.getvalue().count("loss 4.2500") == 3


def test_a_rank_slower_than_the_median_rank_is_named_with_its_work_and_the_step_skew(tmp_path):
    """Rank 2 works 30 ms more than the others' 100 ms in most steps (one step of rank 0's
    is slow too: the median per rank decides): rank 2 is named, and each step's record
    holds its slowest rank and the skew."""
    work = [(0.1, 0.1, 0.13, 0.1)] * 4 + [(0.3, 0.1, 0.13, 0.1)]
    steps = [dataclasses.replace(stats(k + 1), rank_work=w) for k, w in enumerate(work)]
    assert stragglers(steps) == ("ptc run: slower than the median rank's 100.00 ms of work per "
                                 "step (time not waiting for collectives): rank 2 130.00 ms "
                                 "(+30%)")
    assert stragglers([dataclasses.replace(s, rank_work=(0.1, 0.1, 0.12, 0.1))
                       for s in steps]) == ""  # within 25 %
    assert stragglers([dataclasses.replace(s, rank_work=(0.001, 0.001, 0.003, 0.001))
                       for s in steps]) == ""  # 2 ms more: jitter, not a straggler
    assert stragglers([stats(1)]) == ""  # not gathered
    plan = tiny_plan("gpt", zero=0, dp=1, accum=1, metrics=str(tmp_path / "metrics.jsonl"))
    out = io.StringIO()
    with StepReporter(plan, steps=5, enabled=True, console=Console(file=out, width=200)) as rep:
        for step in steps:
            rep.report(step)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["slowest_rank"], round(r["work_skew"], 2)) for r in records] == \
        [(2, 1.3)] * 4 + [(0, 2.61)]
    assert out.getvalue().splitlines()[-1] == stragglers(steps)


def test_other_ranks_stay_silent(tmp_path):
    plan = tiny_plan("gpt", zero=0, dp=1, accum=1, metrics=str(tmp_path / "metrics.jsonl"))
    out = io.StringIO()
    with StepReporter(plan, steps=1, enabled=False, console=Console(file=out)) as reporter:
        reporter.report(stats(1))
    assert out.getvalue() == "" and not (tmp_path / "metrics.jsonl").exists()


def test_progress_bar_on_a_terminal():
    plan = tiny_plan("gpt", zero=0, dp=1, accum=1)
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with StepReporter(plan, steps=2, enabled=True, console=console) as reporter:
        reporter.report(stats(1))
        reporter.report(stats(2))
    assert "2/2" in out.getvalue()


def test_predicted_step_time_hook_is_none_or_positive():
    plan = tiny_plan("gpt", zero=0, dp=1, accum=1)
    value = resolve(capture_plan(plan), plan).predicted_step_time
    assert value is not None and value > 0


def test_health_fields_mfu_nonfinite_steps_and_appending_on_resume(tmp_path):
    plan = tiny_plan("gpt", zero=0, dp=1, accum=1, metrics=str(tmp_path / "metrics.jsonl"))
    bad = StepStats(step=2, loss=float("nan"), lr=1e-3, grad_norm=float("nan"), step_time=0.5,
                    tokens=4096, nonfinite=(1,))
    peak = plan.hardware.peak_flops[plan.train.dtype]
    out = io.StringIO()
    with StepReporter(plan, steps=3, enabled=True, console=Console(file=out),
                      flops_per_step=0.2 * peak) as reporter:
        reporter.report(stats(1))
    with StepReporter(plan, steps=3, enabled=True, console=Console(file=out),
                      flops_per_step=0.2 * peak, append=True) as reporter:
        reporter.report(bad)
    first, second = (json.loads(line) for line in
                     (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert first["mfu"] == pytest.approx(1.0)  # 0.2 s of peak FLOPs in a 0.2 s step
    assert second["mfu"] == pytest.approx(0.4)
    assert (second["loss"], second["grad_norm"], second["nonfinite"]) == (None, None, [1])


def test_model_flops_are_three_forwards_of_the_global_batch():
    from ptc.compiler.graph.meta import get_info
    from ptc.runtime.metrics import model_flops_per_step

    plan = tiny_plan("gpt", zero=0, dp=1, accum=2)  # two micro-batches of one sample
    program = compile_plan(plan)
    forward = sum(get_info(n).flops or 0 for n in program.stages[0].graph.graph.nodes
                  if get_info(n) is not None)
    assert forward > 0
    assert model_flops_per_step(program) == 3 * forward * 2


def test_a_fresh_run_keeps_an_earlier_runs_file_and_says_where(tmp_path):
    path = tmp_path / "metrics.jsonl"
    plan = tiny_plan("gpt", zero=0, dp=1, accum=1, metrics=str(path))
    path.write_text('{"step": 1, "loss": 9.0}\n')
    (tmp_path / "metrics.jsonl.1").write_text('{"step": 1, "loss": 8.0}\n')
    out = io.StringIO()
    with StepReporter(plan, steps=1, enabled=True,
                      console=Console(file=out, width=500)) as reporter:
        reporter.report(stats(1))
    assert (tmp_path / "metrics.jsonl.2").read_text() == '{"step": 1, "loss": 9.0}\n'
    assert (tmp_path / "metrics.jsonl.1").read_text() == '{"step": 1, "loss": 8.0}\n'
    assert [json.loads(line)["loss"] for line in path.read_text().splitlines()] == [4.25]
    assert f"metrics: {path} holds an earlier run's steps; kept as {path}.2" in out.getvalue()


def test_tensorboard_scalars_read_back_with_tensorboards_own_loader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    plan = tiny_plan("gpt", zero=0, dp=1, accum=1)
    plan = dataclasses.replace(plan, runtime=dataclasses.replace(
        plan.runtime, tensorboard=str(tmp_path / "tb")))
    peak = plan.hardware.peak_flops[plan.train.dtype]
    with StepReporter(plan, steps=2, enabled=True, console=Console(file=io.StringIO()),
                      predicted_step_time=0.15, flops_per_step=0.2 * peak) as reporter:
        reporter.report(dataclasses.replace(stats(1), rank_work=(0.15, 0.3)))
        reporter.report(dataclasses.replace(stats(2), loss=3.5, rank_work=(0.15, 0.3)))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(SCALARS)
    read = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in SCALARS}
    assert read["loss"] == [(1, 4.25), (2, 3.5)]
    assert read["step_time"] == [(1, pytest.approx(0.2)), (2, pytest.approx(0.2))]
    assert read["work_skew"] == [(1, pytest.approx(4 / 3)), (2, pytest.approx(4 / 3))]
    assert read["tokens_per_s"][0] == (1, 20480.0)
    assert read["mfu"][0] == (1, pytest.approx(1.0))
    assert read["exposed_comm_s"][0] == (1, pytest.approx(0.05))
    assert read["predicted_step_time"][0] == (1, pytest.approx(0.15))
    assert read["peak_memory_bytes"][0][1] > 0


@pytest.fixture
def offline_wandb(monkeypatch):
    """A function that sends W&B's next runs to a folder, offline (no server is ever reached)
    and quiet. W&B reads its environment once per process, so its state is reset each time,
    as a new process would find it, and after the test."""
    import wandb

    def to(folder: Path) -> None:
        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.setenv("WANDB_DIR", str(folder))
        monkeypatch.setenv("WANDB_SILENT", "true")
        wandb.teardown()

    yield to
    wandb.teardown()


def _wandb_plan(tmp_path: Path):
    """The tiny plan logging to the W&B project "ptc-test", with a checkpoint_dir."""
    plan = tiny_plan("gpt", zero=0, dp=1, accum=1)
    return dataclasses.replace(plan, runtime=dataclasses.replace(
        plan.runtime, wandb="ptc-test", checkpoint_dir=str(tmp_path / "ckpt")))


def _wandb_records(folder: Path, run_id: str) -> dict[str, list[dict]]:
    """The records of the offline W&B run `run_id` under `folder`, by type, as W&B's own reader
    of a run's transaction log (`wandb leet inspect --json`) gives them."""
    [log] = (folder / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                          capture_output=True, text=True, timeout=60, check=True)
    records: dict[str, list[dict]] = {}
    for line in done.stdout.splitlines():
        record = json.loads(line)
        records.setdefault(record["type"], []).append(record[record["type"]])
    return records


@pytest.mark.timeout(180)  # each W&B run and each read starts a process of its own
def test_wandb_gets_the_scalars_of_every_step_and_the_plan_as_config(tmp_path, offline_wandb):
    offline_wandb(tmp_path)
    plan = _wandb_plan(tmp_path)
    peak = plan.hardware.peak_flops[plan.train.dtype]
    with StepReporter(plan, steps=2, enabled=True, console=Console(file=io.StringIO()),
                      predicted_step_time=0.15, flops_per_step=0.2 * peak) as reporter:
        reporter.report(dataclasses.replace(stats(1), rank_work=(0.2,)))
        reporter.report(dataclasses.replace(stats(2), loss=3.5, rank_work=(0.2,)))
    run_id = (tmp_path / "ckpt" / WANDB_RUN_ID).read_text().strip()
    records = _wandb_records(tmp_path, run_id)
    [run] = records["run"]
    assert (run["project"], run["display_name"], run["run_id"]) == ("ptc-test", "ckpt", run_id)
    config = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
    assert config == json.loads(json.dumps(plan_config(plan)))
    assert config["parallel"]["dp"] == 1 and config["runtime"]["wandb"] == "ptc-test"
    history = records["history"]
    assert [h["step"]["num"] for h in history] == [1, 2]
    assert [(h["item"]["loss"], h["item"]["lr"]) for h in history] == [(4.25, 1e-3), (3.5, 1e-3)]
    assert {key for key in history[0]["item"] if not key.startswith("_")} == set(SCALARS)
    first = history[0]["item"]
    assert (first["tokens_per_s"], first["step_time"]) == (20480, pytest.approx(0.2))
    assert first["mfu"] == pytest.approx(1.0) and first["peak_memory_bytes"] > 0
    assert first["predicted_step_time"] == pytest.approx(0.15)
    assert [e["exit_code"] for e in records["exit"]] == [0]


@pytest.mark.timeout(180)  # each W&B run and each read starts a process of its own
def test_a_resumed_run_continues_its_wandb_run_and_a_fresh_one_starts_another(tmp_path,
                                                                             offline_wandb):
    plan = _wandb_plan(tmp_path)
    offline_wandb(tmp_path / "first")
    with StepReporter(plan, steps=3, enabled=True, console=Console(file=io.StringIO())) as r:
        r.report(stats(1))
    run_id = (tmp_path / "ckpt" / WANDB_RUN_ID).read_text().strip()
    offline_wandb(tmp_path / "resumed")  # a later run's own offline folder
    with pytest.raises(RuntimeError), StepReporter(
            plan, steps=3, enabled=True, console=Console(file=io.StringIO()), append=True) as r:
        r.report(dataclasses.replace(stats(2), loss=3.0))
        raise RuntimeError("the resumed run fails")
    resumed = _wandb_records(tmp_path / "resumed", run_id)
    assert [h["step"]["num"] for h in resumed["history"]] == [2]
    assert resumed["history"][0]["item"]["loss"] == 3.0
    assert [e["exit_code"] for e in resumed["exit"]] == [1]  # W&B marks the run failed
    offline_wandb(tmp_path / "fresh")
    with StepReporter(plan, steps=3, enabled=True, console=Console(file=io.StringIO())) as r:
        r.report(stats(1))
    fresh = (tmp_path / "ckpt" / WANDB_RUN_ID).read_text().strip()
    assert fresh != run_id
    assert [h["step"]["num"] for h in _wandb_records(tmp_path / "fresh", fresh)["history"]] == [1]


def test_a_run_opens_with_its_banner_and_closes_with_a_summary():
    from ptc.runtime.metrics import run_banner
    from ptc.units import format_bytes, format_seconds

    plan = tiny_plan("gpt", zero=1, dp=1, accum=1)
    program = compile_plan(plan)
    est = program.decisions.estimate
    banner = run_banner(program)
    assert banner == (f"ptc run: gpt {plan.model.layers} layers, hidden {plan.model.hidden} on 1 "
                      f"x cpu, tp1 pp1 dp1 zero1, fp32; predicted "
                      f"{format_bytes(est.peak_memory_bytes)} peak of "
                      f"{format_bytes(est.budget_bytes)}, {format_seconds(est.step_time_s)} "
                      f"per step (the cpu preset's rates, a guess: ptc calibrate measures this "
                      f"machine's)")
    two_ranks = compile_plan(tiny_plan("gpt", zero=1, dp=2, accum=1))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "cpu_count", lambda: 1)
        assert run_banner(two_ranks).endswith(
            "; 2 ranks share this machine's 1 core and take turns on them")
    out = io.StringIO()
    with StepReporter(plan, steps=3, enabled=True, console=Console(file=out, width=300),
                      predicted_step_time=0.15, banner=banner) as reporter:
        for k, loss in ((1, 5.0), (2, 4.0), (3, 3.0)):
            reporter.report(dataclasses.replace(stats(k), loss=loss,
                                                step_time=(0.3, 0.1, 0.2)[k - 1]))
    lines = out.getvalue().splitlines()
    assert lines[0] == banner
    assert lines[-1].startswith("ptc run: 3 steps, loss from 5.0000 to 3.0000, median step "
                                "200.00 ms (predicted 150.00 ms), rank 0 peak memory ")
    with pytest.raises(RuntimeError), StepReporter(
            plan, steps=3, enabled=True, console=Console(file=(failed := io.StringIO()))):
        raise RuntimeError("a failed run gets no summary")
    assert "ptc run:" not in failed.getvalue()
