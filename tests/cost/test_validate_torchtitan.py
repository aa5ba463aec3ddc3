"""`bench/validate_torchtitan.py` builds a valid plan for every published row, and prints.

The script's score is not asserted (it is what the script reports); what is: every
row becomes a plan that passes ptc's own cross-section checks with no error, the rows
keep the stated mapping rules (global batch = local batch x FSDP, ZeRO-3, sequence
parallelism with tp, torchtitan's pipeline cut), and the summary runs to the end.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ptc.checks import check_plan
from ptc.errors import DiagnosticSink

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def script(monkeypatch):
    """The script as a module, its neighbours (validate_cost_model, ...) importable."""
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("validate_torchtitan",
                                                  BENCH / "validate_torchtitan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_row_builds_a_plan_that_passes_the_checks(script):
    for row in script.RUNS:
        _, model, system, gpus, fsdp, tp, pp, cp, seq, batch, schedule, ac, compiled, \
            precision, async_tp, _, _ = row
        plan = script.build(model, system, gpus, fsdp, tp, pp, cp, seq, batch, schedule, ac,
                            compiled, precision, async_tp)
        sink = DiagnosticSink()
        check_plan(plan, sink)
        assert not sink.errors, (row, [d.message for d in sink.errors])
        par = plan.parallel
        assert (par.tp, par.pp, par.dp, par.cp, par.zero) == (tp, pp, fsdp, cp, 3)
        assert tp * pp * fsdp * cp == gpus == plan.hardware.nodes * plan.hardware.gpus_per_node
        assert plan.train.global_batch == batch * fsdp and plan.train.seq_len == seq
        assert par.sequence_parallel == (tp > 1)
        assert par.tp_comm == ("async" if async_tp else "sync")
        assert plan.runtime.compile == compiled
        assert plan.train.dtype == ("bf16" if precision == "bf16" else "fp8")
        if system == "GrandTeton":
            assert plan.hardware.power_limit == 500.0
        if pp > 1:
            assert plan.num_microbatches == pp
            assert len(par.stage_boundaries) == pp * par.virtual_stages - 1


def test_torchtitan_cut_matches_its_generated_split_points(script):
    # 126 layers on 8 stages: 15, six of 16, 15; on 16 stages: 7, fourteen of 8, 7.
    cuts = script.torchtitan_cut(126, 8)
    assert cuts == tuple(f"layers.{n}" for n in (15, 31, 47, 63, 79, 95, 111))
    starts = [0] + [int(c.split(".")[1]) for c in script.torchtitan_cut(126, 16)] + [126]
    sizes = [b - a for a, b in zip(starts, starts[1:])]
    assert sizes == [7] + [8] * 14 + [7]


def test_the_summary_runs(script, monkeypatch, capsys):
    picked = [script.RUNS[i] for i in (0, 2, 12, 18)]  # fsdp bf16, fp8, pp, tp without memory
    monkeypatch.setattr(script, "RUNS", picked)
    assert script.main() == 0
    out = capsys.readouterr().out
    assert "median |error|" in out and "orderable pairs" in out
    assert "peak memory" in out and "not expressible" in out
    assert len([line for line in out.splitlines() if line.startswith(("T24", "A25"))]) == 4
