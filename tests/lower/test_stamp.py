"""A program whose layers were stamped out equals the program lowered at full depth.

`compile_plan` lowers a deep built-in model at three layers and copies the
middle one out to the plan's depth (`ptc.lower.stamp`). These tests compile
each plan both ways — stamped, and captured and lowered at full depth
(`capture_plan` + `compile_graph`, which never stamp) — and compare the two
programs node by node: every stage graph's ops, targets, operands (by
position), constants, metadata and module provenance, the shapes and dtypes
of every attribute they read (checkpoint regions and ZeRO-3 shard holders
recursively), each stage's layout, overlap plan and place in the pipeline,
the whole-model layout, the tensor-parallel layout, the resolved decisions
and the schedule. Equal programs train alike: the runtime runs nothing else.
Node names are not compared (fx numbers the names of calls: `add_7`).
"""

from __future__ import annotations

import dataclasses
import io
import logging

import pytest
import torch
from rich.console import Console
from torch import fx

from ptc.compiler.graph.meta import get_info, graph_record
from ptc.views.summary import render_summary, summarize
from ptc.lower.driver import capture_plan, compile_graph, compile_plan
from ptc.lower.stamp import MIN_LAYERS, NotStampable, representative_layers, stamp_layers
from ptc.plan import HardwareSpec, ModelSpec, ParallelSpec, Plan, ShardRule, TrainSpec

GPT = ModelSpec(family="gpt", layers=6, hidden=32, heads=4, vocab=64, max_seq=16)
LLAMA = ModelSpec(family="llama", layers=6, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64,
                  max_seq=16)


def plan_of(model: ModelSpec, *, dtype: str = "fp32", micro_batch: int = 2, accum: int = 4,
            **parallel) -> Plan:
    """A CPU plan of `model` with the parallel section `parallel` (fp8 emulated)."""
    par = ParallelSpec(**parallel)
    gpus = par.tp * par.pp * par.dp * par.cp
    return Plan(model=model, hardware=HardwareSpec.preset("cpu", gpus_per_node=gpus),
                parallel=par,
                train=TrainSpec(seq_len=16, global_batch=accum * par.dp * micro_batch,
                                micro_batch=micro_batch, dtype=dtype,
                                fp8_emulate=dtype == "fp8"))


CASES = {
    "gpt tp2 sp dropout": plan_of(dataclasses.replace(GPT, dropout=0.1), tp=2,
                                  sequence_parallel=True),
    "llama tp2 sp bf16 pp2 interleaved": plan_of(
        dataclasses.replace(LLAMA, layers=8), dtype="bf16", tp=2, sequence_parallel=True, pp=2,
        schedule="interleaved", virtual_stages=2),
    "gpt pp3 dp2 zero1 selective dropout": plan_of(
        dataclasses.replace(GPT, dropout=0.1), pp=3, dp=2, zero=1, checkpoint="selective"),
    "llama tp2 dp2 zero3 full": plan_of(LLAMA, tp=2, dp=2, zero=3, checkpoint="full"),
    "gpt dp2 zero3 per-layer policies": plan_of(
        GPT, dp=2, zero=3, checkpoint=("full", "none", "selective", "ops", "full", "none")),
    "llama tp4 zero2 modules": plan_of(dataclasses.replace(LLAMA, heads=8, kv_heads=4), tp=4,
                                       dp=1, zero=2, checkpoint="modules(mlp, norm)"),
    "gpt tp2 pp2 uneven split, overlap off": plan_of(
        dataclasses.replace(GPT, layers=7), tp=2, pp=2, first_stage_layers=3, overlap=False),
    "llama 4 layers pp2 dp2 bf16": plan_of(dataclasses.replace(LLAMA, layers=MIN_LAYERS),
                                           dtype="bf16", pp=2, dp=2),
    "gpt tp2 uniform shard rule": plan_of(
        GPT, tp=2, shards=(ShardRule(pattern="layers.*.mlp.*", style="replicate"),)),
    "gpt tp2 checkpoint auto": plan_of(GPT, tp=2, dp=2, zero=1, checkpoint="auto"),
    "llama 5 layers pp5, a layer a stage": plan_of(dataclasses.replace(LLAMA, layers=5), pp=5,
                                                   accum=5),
    "gpt dp3 zero3 bf16 dropout": plan_of(dataclasses.replace(GPT, dropout=0.1), dtype="bf16",
                                          dp=3, zero=3, checkpoint="selective"),
}


@pytest.mark.parametrize("name", CASES)
def test_a_stamped_program_equals_the_one_lowered_at_full_depth(name):
    plan = CASES[name]
    assert representative_layers(plan) is not None
    seen = []
    stamped = compile_plan(plan, on_capture=lambda gm: seen.append((graph_rows(gm),
                                                                     summary_text(gm))))
    assert graph_record(stamped.stages[0].graph).capture.num_layers == plan.model.layers
    full_captured = capture_plan(plan)
    assert seen == [(graph_rows(full_captured), summary_text(full_captured))]
    full = compile_graph(full_captured, plan)  # lowers the captured graph in place
    assert program_differences(stamped, full) == []


def test_the_pass_log_says_which_layers_the_whole_graph_passes_saw():
    plan = CASES["gpt tp2 sp dropout"]
    log = compile_plan(plan).pass_log
    stamp = [line for line in log if line.startswith("stamp_layers_pass")]
    assert stamp == ["stamp_layers_pass: the passes above lowered layers 0, 1 and 2 of 6 "
                     "(their counts are of those); layer 1 copied to layers 2..4, layer 2 "
                     "moved to layer 5"]
    four = dataclasses.replace(plan, model=dataclasses.replace(plan.model, layers=4))
    assert "layer 1 copied to layer 2, layer 2 moved to layer 3" in \
        next(line for line in compile_plan(four).pass_log if line.startswith("stamp_layers"))


def test_a_shard_rule_naming_one_layer_is_lowered_at_full_depth(caplog):
    """`layers.3.mlp.*` replicate keeps one layer's MLP whole: copies of layer 1 would split
    it. The driver finds that and compiles at full depth, so the program is still right."""
    rule = ShardRule(pattern="layers.3.mlp.*", style="replicate")
    plan = plan_of(GPT, tp=2, shards=(rule,))
    with pytest.raises(NotStampable, match="shard rule treats layer 3"):
        stamp_layers(capture_plan(plan, layers=3), GPT.layers, plan)
    with caplog.at_level(logging.DEBUG, logger="ptc.lower.driver"):
        program = compile_plan(plan)
    assert "compiling at full depth" in caplog.text
    assert not any(line.startswith("stamp_layers_pass") for line in program.pass_log)
    assert program_differences(program, compile_graph(capture_plan(plan), plan)) == []
    whole = program.tensor_parallel.params
    assert "layers.3.mlp.up.weight" not in whole and "layers.2.mlp.up.weight" in whole


@pytest.mark.parametrize("plan, why", [
    (plan_of(dataclasses.replace(GPT, layers=MIN_LAYERS - 1), tp=2), "too shallow"),
    (plan_of(GPT, cp=2), "context parallelism"),
    (plan_of(GPT, dtype="fp8"), "fp8"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_plans_whose_passes_are_not_per_layer_are_not_stamped(plan, why):
    assert representative_layers(plan) is None


# ------------------------------------------------------------------ comparison


def summary_text(gm: fx.GraphModule) -> str:
    """`ptc compile`'s summary of a captured graph, as text."""
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(render_summary(summarize(gm)))
    return console.export_text()


def program_differences(a, b) -> list[str]:
    """Where two Programs differ (empty: equal, node names aside)."""
    out = [field for field in ("layout", "tensor_parallel", "decisions", "schedule")
           if getattr(a, field) != getattr(b, field)]
    if len(a.stages) != len(b.stages):
        return [*out, f"{len(a.stages)} vs {len(b.stages)} stages"]
    for program in (a, b):  # what a stage sends is what the next one receives, by name
        for sent, received in zip(program.stages, program.stages[1:]):
            if sent.info.outputs != received.info.inputs:
                out.append(f"stage {sent.index} sends other values than the next receives")
    for sa, sb in zip(a.stages, b.stages):
        out += [f"stage {sa.index} {field}" for field in ("layout", "overlap")
                if getattr(sa, field) != getattr(sb, field)]
        if unnamed(sa.info) != unnamed(sb.info):
            out.append(f"stage {sa.index} info")
        rows_a, rows_b = graph_rows(sa.graph), graph_rows(sb.graph)
        if len(rows_a) != len(rows_b):
            out.append(f"stage {sa.index}: {len(rows_a)} vs {len(rows_b)} nodes")
            continue
        out += [f"stage {sa.index} node {i}: {x} vs {y}"
                for i, (x, y) in enumerate(zip(rows_a, rows_b)) if x != y][:3]
    return out


def unnamed(info):
    """A StageInfo without the names of the values crossing its edges (node names)."""
    def strip(boundaries):
        return tuple(dataclasses.replace(b, name="") for b in boundaries)
    return dataclasses.replace(info, inputs=strip(info.inputs), outputs=strip(info.outputs))


def graph_rows(gm: fx.GraphModule) -> list[tuple]:
    """Per node: op, target (a placeholder's is its name), operands (nodes by position),
    NodeInfo, module provenance, and what an attribute it reads holds."""
    position: dict[fx.Node, int] = {}
    rows = []
    for i, node in enumerate(gm.graph.nodes):
        position[node] = i
        stack = node.meta.get("nn_module_stack")
        target = None if node.op == "placeholder" else node.target
        rows.append((node.op, target, _operands(node.args, position),
                     _operands(node.kwargs, position), get_info(node),
                     tuple(stack.values()) if stack else None, _attribute(gm, node)))
    return rows


def _operands(value, position):
    if isinstance(value, fx.Node):
        return ("node", position[value])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_operands(v, position) for v in value))
    if isinstance(value, dict):
        return tuple((k, _operands(v, position)) for k, v in value.items())
    return value


def _attribute(gm: fx.GraphModule, node: fx.Node):
    if node.op not in ("get_attr", "call_module"):
        return None
    value = gm
    for part in str(node.target).split("."):
        value = getattr(value, part)
    if isinstance(value, torch.Tensor):
        return (type(value).__name__, tuple(value.shape), value.dtype, value.requires_grad)
    if isinstance(value, fx.GraphModule):
        return ("graph", graph_rows(value))
    return (type(value).__name__,
            tuple((n, tuple(t.shape), t.dtype, t.requires_grad)
                  for n, t in value.named_parameters(remove_duplicate=False)),
            tuple((n, tuple(t.shape), t.dtype) for n, t in value.named_buffers()))


@pytest.mark.parametrize("pp", [1, 2])
def test_a_stamp_that_records_a_wrong_shape_is_named_by_the_verifier(monkeypatch, pp):
    """The verifier re-runs the stamped graph on meta, as any pass's output, and names the
    stamp."""
    from ptc.compiler.graph.meta import update_info
    from ptc.errors import CompileError
    from ptc.lower import driver, stamp

    def stamp_layers_pass(gm, decisions):
        out = stamp.stamp_layers_pass(gm, decisions)
        node = next(n for n in out.graph.nodes if n.op == "call_function"
                    and (info := get_info(n)) is not None and info.layer == 3 and info.shapes)
        update_info(node, shapes=((7, 7, 7),))
        return out

    monkeypatch.setattr(driver, "stamp_layers_pass", stamp_layers_pass)
    with pytest.raises(CompileError, match=r"after pass stamp_layers_pass is broken: node .* "
                                           r"records shapes \(\(7, 7, 7\),\)"):
        compile_plan(plan_of(GPT, pp=pp, accum=2))
