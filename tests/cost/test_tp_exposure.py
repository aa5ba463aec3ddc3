"""Tensor-parallel communication is priced as ptc's runtime exposes it
(`ptc.compiler.cost.tp_exposure`): with `tp_comm = sync` the forward's
all-gathers and reduce-scatters and the backward's all-gathers of the exits'
gradients wait in full, and only the backward of the entries (re-gather and
input-gradient reduce-scatter) runs beside the column-parallel linears'
gradients; with `tp_comm = async` (collective matmuls) each collective runs
beside (tp - 1)/tp of the GEMMs it feeds. Expected values are computed here
from the table in the module docstring, on figures chosen so each row is
either hidden or not."""

from __future__ import annotations

import dataclasses

import pytest

from ptc.compiler.cost.tp_exposure import BoundaryCollectives, LinearTimes, layer_tp_time
from ptc.compiler.profile.cache import model_profile
from ptc.compiler.search.estimate import estimate
from ptc.compiler.shapes import plan_from_shape
from ptc.plan import ModelSpec

LLAMA = ModelSpec(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128,
                  max_seq=16)
EACH = BoundaryCollectives(all_gather=1.0, reduce_scatter=1.0, all_reduce=2.0)


def _time(*, sp: bool, async_tp: bool, overlap: bool = True, linears=LinearTimes(0.0, 0.0),
          regathers: int = 2, rerun: bool = False, tp: int = 4):
    profile = model_profile(LLAMA, "fp32")
    assert (profile.tp_entries, profile.tp_exits) == (2, 2)
    return layer_tp_time(profile, tp=tp, sp=sp, async_tp=async_tp, overlap=overlap,
                         rerun_layer=rerun, regathers=regathers, each=EACH, linears=linears,
                         exposed_extra=0.0)


def test_without_compute_beside_them_every_collective_is_exposed() -> None:
    # Forward 2 gathers + 2 scatters, backward 2 re-gathers + 2 scatters + 2 gathers.
    for async_tp in (False, True):
        t = _time(sp=True, async_tp=async_tp)
        assert t.issued == t.exposed == 10.0
    t = _time(sp=False, async_tp=False)  # forward 2 all-reduces, backward 2
    assert t.issued == t.exposed == 8.0


def test_sync_hides_only_the_entries_backward_behind_the_column_linears() -> None:
    long = LinearTimes(column=100.0, row=100.0)
    t = _time(sp=True, async_tp=False, linears=long)
    assert t.exposed == pytest.approx(2 + 2 + 2)  # forward gathers, scatters; exit gradients
    assert t.hidden == pytest.approx(4.0)
    t = _time(sp=False, async_tp=False, linears=long)
    assert t.exposed == pytest.approx(4.0)  # the forward's all-reduces


def test_async_hides_every_collective_behind_tp_minus_one_chunks_of_its_gemms() -> None:
    long = LinearTimes(column=100.0, row=100.0)
    assert _time(sp=True, async_tp=True, linears=long).exposed == 0.0
    # Column GEMMs of 4 s at tp 4: 3 s beside each entry row of 2 s; row GEMMs of 2 s: 1.5 s
    # beside the 2 s of forward scatters, 3 s beside the exits' backward gathers.
    t = _time(sp=True, async_tp=True, linears=LinearTimes(column=4.0, row=2.0))
    assert t.exposed == pytest.approx(0.5)
    assert t.issued == 10.0


def test_without_overlap_nothing_hides() -> None:
    t = _time(sp=True, async_tp=True, overlap=False, linears=LinearTimes(100.0, 100.0))
    assert t.exposed == t.issued


def test_a_rerun_layer_repeats_the_forward_collectives() -> None:
    assert _time(sp=True, async_tp=False, rerun=True).issued == 14.0
    assert _time(sp=False, async_tp=False, rerun=True).issued == 12.0


def _plan(tp_comm: str, sp: bool = True):
    plan = plan_from_shape(family="llama", layers=32, hidden=4096, heads=32, kv_heads=8,
                           ffn=14336, vocab=128256, seq_len=8192, global_batch=64,
                           gpu="H100-SXM", num_gpus=64, tp=8, pp=1, micro_batch=1,
                           dtype="bf16", zero=1, sequence_parallel=sp, tp_comm=tp_comm,
                           checkpoint="none", overlap=True)
    return dataclasses.replace(plan, runtime=dataclasses.replace(plan.runtime, compile=True))


def test_collective_matmuls_make_a_tp8_step_faster_and_show_what_they_hide() -> None:
    sync, async_ = estimate(_plan("sync")), estimate(_plan("async"))
    assert async_.breakdown["tp_comm"] < sync.breakdown["tp_comm"]
    assert async_.step_time_s < sync.step_time_s
    assert async_.hidden["tp_comm"] > sync.hidden["tp_comm"] > 0
    # The same bytes are issued either way: exposed + hidden is the same.
    assert async_.breakdown["tp_comm"] + async_.hidden["tp_comm"] == pytest.approx(
        sync.breakdown["tp_comm"] + sync.hidden["tp_comm"], rel=1e-9)


def test_explain_shows_each_kind_issued_hidden_and_exposed() -> None:
    """tp 8 × pp 4 × dp 2 (ZeRO-1, overlap): tp's entries hide their backward beside the
    column-parallel linears' gradients, the pipeline's hops all but fill and drain, the
    gradient reduction behind the last backward and the weight gathers behind the next
    forward; `ptc explain` prints issued, hidden and exposed per kind."""
    from pathlib import Path  # noqa: PLC0415

    from rich.console import Console  # noqa: PLC0415

    from ptc.dsl import load_plan  # noqa: PLC0415
    from ptc.views.explain import render_explain  # noqa: PLC0415

    path = Path(__file__).resolve().parents[2] / "examples" / "llama70b_h100x64_tp8_pp4_dp2.ptc"
    plan = load_plan(path)
    est = estimate(plan)
    assert {"tp_comm", "pp_comm", "dp_comm"} <= set(est.hidden)
    console = Console(width=80, record=True)
    console.print(render_explain(plan, est, compiled=False))
    text = console.export_text()
    assert "Communication: issued = hidden beside compute + exposed" in text
    row = next(line for line in text.splitlines() if "tp_comm" in line and "│" in line
               and line.count("│") == 5)
    assert row.split("│")[1].strip() == "tp_comm"
