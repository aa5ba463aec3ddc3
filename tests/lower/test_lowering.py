"""The compile driver: one Decisions record, the cost model once, the verifier, disabled passes."""

from __future__ import annotations

import dataclasses
import operator
import re
import sys
from pathlib import Path

import pytest
import torch

import ptc
import ptc.compiler.search.estimate as estimate_module
from ptc import HardwareSpec, ModelSpec, ParallelSpec, Plan, TrainSpec
from ptc.compiler.capture import capture
from ptc.compiler.graph.meta import graph_record
from ptc.errors import CompileError
from ptc.lower.driver import PASSES, capture_plan, compile_graph, compile_plan, lower_graph
from ptc.lower.verify import Rerun, verify_graph
from ptc.ops.collectives import gather_params
from ptc.ops.comm import ShapeGroup, bind_axes
from ptc.ops.tp_ops import all_gather_seq, reduce_from_tp, reduce_scatter_seq, scatter_seq

MODEL = ModelSpec(family="llama", layers=4, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64,
                  max_seq=16)


def plan(**parallel) -> Plan:
    par = ParallelSpec(**{"tp": 1, "pp": 2, "dp": 1, "checkpoint": "auto", **parallel})
    return Plan(model=MODEL, hardware=HardwareSpec.preset("cpu", gpus_per_node=par.tp * par.pp * par.dp),
                parallel=par, train=TrainSpec(seq_len=16, global_batch=4, micro_batch=1))


@pytest.mark.parametrize("parallel", [dict(), dict(tp=2, sequence_parallel=True, zero=3),
                                      dict(pp=1, checkpoint="selective")])
def test_the_cost_model_runs_once_per_compile(monkeypatch, parallel):
    """checkpoint = auto, the pipeline cut and the predicted step time come from one call of
    the cost model (`balanced_cut`, which prices the candidate cuts): no pass prices again."""
    calls, cuts = [], []
    real_cost, real_cut = estimate_module.step_cost, estimate_module.balanced_cut
    monkeypatch.setattr(estimate_module, "step_cost",
                        lambda *a, **k: calls.append(1) or real_cost(*a, **k))

    def counted_cut(*a, **k):
        before = len(calls)
        out = real_cut(*a, **k)
        cuts.append(len(calls) - before)
        return out

    monkeypatch.setattr(estimate_module, "balanced_cut", counted_cut)
    program = compile_plan(plan(**parallel))
    assert len(cuts) == 1 and cuts[0] == len(calls) >= 1
    assert program.predicted_step_time == program.decisions.estimate.step_time_s > 0
    assert len(program.decisions.checkpoint) == MODEL.layers


def test_stages_read_the_one_layout_the_split_fixed():
    program = compile_plan(plan(zero=3))
    for stage in program.stages:
        assert stage.layout is program.decisions.layouts[stage.index]
        assert stage.overlap is program.decisions.overlap[stage.index]
        assert stage.overlap == graph_record(stage.graph).overlap  # the pass's, as recorded
        assert stage.info.num_stages == 2


def test_pp1_is_one_stage_with_a_one_stage_schedule():
    program = compile_plan(plan(pp=1))
    (stage,) = program.stages
    assert stage.info.is_first and stage.info.is_last and stage.info.data == ("tokens", "targets")
    assert [str(a) for a in program.schedule.ranks[0][:4]] == ["0F0", "0B0", "0F1", "0B1"]


def test_verifier_names_the_pass_that_broke_the_graph():
    p = plan(pp=1, checkpoint="none")
    gm = capture_plan(p)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    with gm.graph.inserting_after(node):
        gm.graph.call_function(operator.neg, (node,))  # a created node without ptc metadata
    with pytest.raises(CompileError, match=r"after pass my_pass is broken: node neg\w* .* no ptc "
                                           r"metadata"):
        verify_graph(gm, p, after="my_pass")


def test_verifier_catches_a_parameter_resized_without_its_metadata():
    p = plan(pp=1, checkpoint="none")
    gm = capture_plan(p)
    attr = next(n for n in gm.graph.nodes if n.op == "get_attr")
    owner, _, leaf = str(attr.target).rpartition(".")
    module = gm.get_submodule(owner) if owner else gm
    setattr(module, leaf, torch.nn.Parameter(torch.empty(3, device="meta")))
    with pytest.raises(CompileError, match=r"records shape .* of shape \(3,\)"):
        verify_graph(gm, p, after="resize_pass")


def test_verifier_reruns_the_graph_on_meta_and_compares_shapes():
    p = plan(pp=1, checkpoint="none")
    gm = capture_plan(p)
    view = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "view")
    *lead, heads, dim = view.args[1:]
    view.args = (view.args[0], *lead, dim, heads)  # still runs; no longer what it records
    with pytest.raises(CompileError, match=rf"after pass reshape_pass is broken: node "
                                           rf"{view.name} \(call_method view\) records shapes "
                                           rf".*, a meta re-run gives"):
        verify_graph(gm, p, after="reshape_pass")


def _checked_once(p: Plan):
    """A captured graph and the Rerun of a first, passing check of it."""
    gm = capture_plan(p)
    rerun = Rerun(gm)
    verify_graph(gm, p, after="capture", rerun=rerun)
    assert rerun.checked  # the second check below can take nodes from the first
    return gm, rerun


def test_a_second_check_reruns_what_reads_a_resized_buffer():
    """A table changed under unchanged nodes: the nodes reading it are not taken from before."""
    p = plan(pp=1, checkpoint="none")
    gm, rerun = _checked_once(p)
    attr = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target.endswith("rope.cos"))
    owner, _, leaf = str(attr.target).rpartition(".")
    rows, cols = attr.meta["ptc"].shapes[0]
    dtype = attr.meta["ptc"].dtypes[0]
    gm.get_submodule(owner).register_buffer(leaf, torch.empty(rows, cols // 2, dtype=dtype,
                                                              device="meta"))
    attr.meta["ptc"] = dataclasses.replace(attr.meta["ptc"], shapes=((rows, cols // 2),))
    with pytest.raises(CompileError, match=r"fails when re-run|a meta re-run gives"):
        verify_graph(gm, p, after="resize_pass", rerun=rerun)


def test_a_second_check_reruns_what_follows_a_changed_node():
    """Only the view changed: everything after it that reads its value is re-run and disagrees."""
    p = plan(pp=1, checkpoint="none")
    gm, rerun = _checked_once(p)
    view = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "view")
    *lead, heads, dim = view.args[1:]
    view.args = (view.args[0], *lead, dim, heads)
    view.meta["ptc"] = dataclasses.replace(view.meta["ptc"],
                                           shapes=((*view.meta["ptc"].shapes[0][:-2], dim, heads),))
    with pytest.raises(CompileError, match=r"after pass reshape_pass is broken: node (?!"
                                           + view.name + r" )\w+ .* a meta re-run gives"):
        verify_graph(gm, p, after="reshape_pass", rerun=rerun)


def test_a_second_check_compares_a_changed_record_with_an_unchanged_node():
    p = plan(pp=1, checkpoint="none")
    gm, rerun = _checked_once(p)
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.meta["ptc"].shapes)
    wrong = tuple(d + 1 for d in node.meta["ptc"].shapes[0])
    node.meta["ptc"] = dataclasses.replace(node.meta["ptc"], shapes=(wrong,))
    with pytest.raises(CompileError, match=rf"node {node.name} .* "
                       + re.escape(f"records shapes ({wrong},)")):
        verify_graph(gm, p, after="record_pass", rerun=rerun)


@pytest.mark.parametrize("parallel", [dict(tp=2, sequence_parallel=True, zero=3, dp=2),
                                      dict(tp=2, checkpoint="full", zero=3, dp=2)])
def test_every_lowered_graph_agrees_with_its_meta_rerun(parallel):
    """The collectives under ShapeGroups give what the passes recorded, stage by stage."""
    p = plan(**parallel)
    for stage in compile_plan(p).stages:
        verify_graph(stage.graph, p, after="the last pass")
        nodes = {n.target for n in stage.graph.graph.nodes if n.op == "call_function"}
        assert gather_params in nodes


def test_a_shape_group_gives_the_shapes_its_ranks_would():
    x = torch.empty(2, 8, 4, device="meta")
    with bind_axes({"tp": ShapeGroup(4)}):
        assert all_gather_seq(x, 1).shape == (2, 32, 4)
        assert reduce_scatter_seq(x, 1).shape == (2, 2, 4)
        assert scatter_seq(x, 1).shape == (2, 2, 4)
        assert reduce_from_tp(x).shape == (2, 8, 4)


def test_disabling_an_optional_pass_skips_it(monkeypatch):
    monkeypatch.setenv("PTC_DISABLE_PASSES", "overlap_collectives_pass")
    p = plan(pp=1)
    _, lowered = lower_graph(capture_plan(p), p)
    assert not any(line.startswith("overlap_collectives_pass") for line in lowered.log)
    assert graph_record(lowered.stages[0]).overlap is None


def test_a_pass_the_plan_needs_cannot_be_disabled(monkeypatch):
    monkeypatch.setenv("PTC_DISABLE_PASSES", "split_pipeline_pass")
    with pytest.raises(CompileError, match=r"split_pipeline_pass cannot be skipped: the plan's "
                                           r"pp > 1 needs it"):
        compile_plan(plan())


def test_an_unknown_pass_name_lists_the_passes(monkeypatch):
    monkeypatch.setenv("PTC_DISABLE_PASSES", "no_such_pass")
    p = plan(pp=1)
    with pytest.raises(CompileError, match="no pass named no_such_pass; the passes are "
                                           + ", ".join(PASSES.names())):
        compile_graph(capture_plan(p), dataclasses.replace(p))


CUSTOM = ModelSpec(family="custom", factory="tests.user_models.nanogpt:nanogpt",
                   kwargs={"n_layer": 2, "n_head": 4, "n_embd": 32, "vocab_size": 64,
                           "block_size": 16}, vocab=64, max_seq=16)


def test_a_custom_model_is_priced_from_its_own_graph():
    p = dataclasses.replace(plan(pp=1), model=CUSTOM)
    est = ptc.estimate(p)
    assert est.step_time_s > 0 and est.peak_memory_bytes > 0
    program = compile_plan(p)  # plan() asks for checkpoint = auto: the memory model chooses
    assert program.predicted_step_time == pytest.approx(est.step_time_s)
    assert program.decisions.unpriced is None
    assert set(program.decisions.checkpoint) <= {"none", "selective", "full"}


def test_a_custom_model_takes_its_vocabulary_from_the_captured_logits():
    no_vocab = dataclasses.replace(CUSTOM, vocab=None, max_seq=None)
    p = dataclasses.replace(plan(pp=1, checkpoint="none"), model=no_vocab)
    assert compile_plan(p).vocab == 64  # what synthetic data draws below, and files are checked by
    assert compile_plan(dataclasses.replace(p, model=dataclasses.replace(
        no_vocab, vocab=50))).vocab == 50  # a table wider than the ids used (padded): fine
    with pytest.raises(CompileError, match=r"model.vocab = 100, but GPT's logits have only 64 "
                                           r"columns: ids up to 99 would fall outside"):
        compile_plan(dataclasses.replace(p, model=dataclasses.replace(no_vocab, vocab=100)))


class _InPlaceView(torch.nn.Module):
    """A call that changes its operand's strides in place (x.transpose_ of a square [s, h])."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * 2.0
        x.transpose_(1, 2)  # seq_len = hidden = 16: the same shape, other strides
        return self.head(x)


def test_a_call_that_writes_into_its_operand_leaves_the_kept_values_alone():
    """Checks share the values they keep; the in-place call changes a copy of its own."""
    p = plan(pp=1, checkpoint="none")
    gm = capture(_InPlaceView(), micro_batch=1, seq_len=16, front_door="fx")
    rerun = Rerun(gm)
    for after in ("capture", "a pass that changed nothing"):
        verify_graph(gm, p, after=after, rerun=rerun)
    scaled = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is operator.mul)
    assert rerun.checked[scaled].value.stride() == (256, 16, 1)  # as the multiply made it


def test_a_compile_pauses_the_garbage_collector_and_gives_it_back(monkeypatch):
    """Compiling runs without Python's cyclic collector, which is on again after it, after a
    failing compile too, and stays off after it for a caller that had turned it off."""
    import gc

    seen = []
    real = lower_graph

    def spying_lower(*args, **kwargs):
        seen.append(gc.isenabled())
        if len(seen) == 2:
            raise CompileError("a pass failed")
        return real(*args, **kwargs)

    monkeypatch.setattr("ptc.lower.driver.lower_graph", spying_lower)
    assert gc.isenabled()
    compile_plan(plan())
    assert seen == [False] and gc.isenabled()
    with pytest.raises(CompileError, match="a pass failed"):
        compile_plan(plan())
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:
        compile_plan(plan())
        assert not gc.isenabled()
    finally:
        gc.enable()
    # The CLI turns it off for its commands but run, and on again when called from Python.
    from ptc.cli import main

    example = Path(__file__).resolve().parents[2] / "examples" / "tiny_gpt_cpu.ptc"
    assert main(["compile", str(example)]) == 0 and gc.isenabled()


def test_the_ptc_program_keeps_the_collector_off_but_to_train(monkeypatch):
    """The `ptc` program (`entry`) turns the collector off before its imports and leaves it
    off after a command: the process ends. `run` trains with it on."""
    import gc

    from ptc import cli

    example = Path(__file__).resolve().parents[2] / "examples" / "tiny_gpt_cpu.ptc"
    seen = []
    monkeypatch.setattr(cli, "cmd_run", lambda args: seen.append(gc.isenabled()) or 0)
    try:
        monkeypatch.setattr(sys, "argv", ["ptc", "compile", str(example)])
        assert cli.entry() == 0 and not gc.isenabled()
        monkeypatch.setattr(sys, "argv", ["ptc", "run", str(example)])
        assert cli.entry() == 0 and seen == [True]
    finally:
        gc.enable()
