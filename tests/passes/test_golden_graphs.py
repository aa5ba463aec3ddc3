"""Golden snapshots of what each pass does to the graph, for a handful of tiny plans.

`compile_plan` lowers each plan below; the runner shows every graph it checks (the
captured one, then the graph after each pass, per stage after the split) to its dump
hook (`ptc.lower.runner._dump`, what `PTC_DUMP_DIR` writes), which this test takes over
to render each graph as stable text: one line per node — its name, op, target (a
module's path and class, a function's qualified name: the ptc ops a pass inserted read
`ptc.ops.…`), its operands by node name, and the layer it came from. Nothing
run-dependent goes in (no ids, addresses or timings; an object that is neither a node
nor a plain value prints as its type's name). The golden file of a plan holds the
captured graph in full, then what each pass changed as a unified diff against the graph
before it ("unchanged" where it changed nothing), then every lowered stage graph in
full: a pass that inserts one node more, moves a wait, or loses a layer's provenance
shows as a one-line diff in review.

The golden files are tests/passes/golden/<plan>.txt. A mismatch fails with the unified
diff of expected against got; when the change is intended,
`PTC_UPDATE_GOLDEN=1 pytest tests/passes/test_golden_graphs.py` rewrites them (review
the diff: a graph change is a lowering change). The rendering is deterministic: the
same plan gives the same text in another process, under another hash seed
(`test_rendering_does_not_depend_on_the_process`).

What the inserted nodes compute is proven elsewhere: against eager PyTorch on one
process in the tests beside this one (tests/passes), on several in tests/distributed.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import fx
from torch.fx.node import _get_qualified_name

from ptc.compiler.graph.stage_graphs import pipeline_stages
from ptc.compiler.records.graph_meta import KEY
from ptc.lower import runner
from ptc.lower.driver import compile_plan
from ptc.plan import HardwareSpec, ModelSpec, ParallelSpec, Plan, TrainSpec

GOLDEN = Path(__file__).parent / "golden"
UPDATE = "PTC_UPDATE_GOLDEN"

GPT = ModelSpec(family="gpt", layers=2, hidden=32, heads=4, vocab=64, max_seq=16)
LLAMA = ModelSpec(family="llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64,
                  max_seq=16)


def _plan(model: ModelSpec, **parallel) -> Plan:
    world = parallel.get("tp", 1) * parallel.get("pp", 1) * parallel.get("dp", 1)
    micro = 2 if parallel.get("pp", 1) > 1 else 1
    return Plan(model=model, hardware=HardwareSpec.preset("cpu", gpus_per_node=world),
                parallel=ParallelSpec(**parallel),
                train=TrainSpec(seq_len=16, micro_batch=1,
                                global_batch=micro * parallel.get("dp", 1), dtype="fp32"))


PLANS = {
    # tensor parallelism with sequence parallelism: copy/reduce become gather/scatter of
    # the sequence, fused with the column-parallel linears by the overlap pass
    "gpt_tp2_sp": _plan(GPT, tp=2, sequence_parallel=True),
    "llama_tp2": _plan(LLAMA, tp=2),
    # collective matmuls: each all-gather with its column-parallel linears, each row-parallel
    # linear with its reduce-scatter, one op each
    "llama_tp2_sp_async": _plan(LLAMA, tp=2, sequence_parallel=True, tp_comm="async"),
    # the pipeline split: two stage graphs, the tied embedding on both ends
    "gpt_pp2_1f1b": _plan(GPT, pp=2, schedule="1f1b"),
    # ZeRO-3: a gather per parameter group, started ahead (prefetch) by the overlap pass
    "llama_dp2_zero3": _plan(LLAMA, dp=2, zero=3),
    # selective recompute: checkpoint regions around each layer's attention core
    "gpt_dp2_checkpoint_selective": _plan(GPT, dp=2, zero=1, checkpoint="selective"),
    # a deeper model compiled at a few layers and stamped out, three axes at once
    "llama4_tp2_sp_pp2_dp2_zero3": _plan(dataclasses.replace(LLAMA, layers=4), tp=2,
                                         sequence_parallel=True, pp=2, dp=2, zero=3),
}


def _value(arg) -> str:
    """An operand as stable text: a node by name, plain values by repr, else a type name."""
    if isinstance(arg, fx.Node):
        return f"%{arg.name}"
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_value(a) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner}{',' if len(arg) == 1 else ''})"
    if isinstance(arg, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in arg.items()) + "}"
    if arg is None or isinstance(arg, (bool, int, float, str, slice, torch.dtype,
                                       torch.device, torch.memory_format, torch.layout)):
        return repr(arg) if not isinstance(arg, (torch.dtype, torch.device)) else str(arg)
    if arg is Ellipsis:
        return "..."
    return type(arg).__name__


def _target(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        return f"{node.target} {type(gm.get_submodule(node.target)).__name__}"
    if node.op == "call_function":
        try:
            return _get_qualified_name(node.target)
        except (AttributeError, RuntimeError, TypeError):
            return str(node.target)
    return str(node.target) if node.op in ("call_method", "get_attr") else ""


def render(gm: fx.GraphModule, indent: str = "") -> str:
    """One line per node: name = op target(operands)  [L<layer>]; then, indented, every
    graph the nodes call or read (checkpoint regions, a pipeline's stages)."""
    lines, nested = [], {}
    for node in gm.graph.nodes:
        operands = [_value(a) for a in node.args] + [f"{k}={_value(v)}"
                                                    for k, v in node.kwargs.items()]
        target = _target(gm, node)
        info = node.meta.get(KEY)
        layer = getattr(info, "layer", None)
        where = f"  [L{layer}]" if layer is not None else ""
        call = f" {target}" if target else ""
        args = f"({', '.join(operands)})" if node.op not in ("placeholder", "get_attr") else ""
        lines.append(f"{indent}{node.name} = {node.op}{call}{args}{where}")
        if node.op in ("get_attr", "call_module"):
            sub = _attribute(gm, node.target)
            if isinstance(sub, fx.GraphModule):
                nested.setdefault(node.target, sub)
    for name, sub in nested.items():
        lines.append(f"{indent}{name}:")
        lines.append(render(sub, indent + "    ").rstrip("\n"))
    return "\n".join(lines) + "\n"


def _attribute(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def lowering_text(plan: Plan, monkeypatch: pytest.MonkeyPatch) -> str:
    """The golden text of `plan`: the captured graph, each pass's diff, the stage graphs."""
    shown: list[tuple[str, str, str]] = []  # (pass, stage, rendering)
    before: dict[str, str] = {}  # per stage ("" before the split), the graph before the pass

    def show(_dir, _index, name: str, gm: fx.GraphModule) -> None:
        stage = name.partition(".")[2]
        shown.append((name, stage, render(gm)))
        for s, (_, graph) in enumerate(pipeline_stages(gm)):  # the split's stage graphs
            before[f"stage{s}"] = render(graph)

    monkeypatch.setattr(runner, "_dump", show)
    program = compile_plan(plan)
    assert shown and shown[0][0] == "captured", "the runner no longer shows its graphs"
    out = ["== captured ==", shown[0][2]]
    last = {"": shown[0][2]}  # per stage, the graph after the last pass shown
    for name, stage, text in shown[1:]:
        previous = last.get(stage, before.get(stage, last[""]))
        last[stage] = text
        diff = list(difflib.unified_diff(previous.splitlines(), text.splitlines(), lineterm="",
                                         n=1))[2:]
        out += [f"== after {name}: {'unchanged' if not diff else 'diff'} =="] + diff + [""]
    for s, stage in enumerate(program.stages):
        out += [f"== lowered stage {s} ==", render(stage.graph)]
    return "\n".join(out)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(PLANS))
def test_lowered_graphs_match_the_golden_file(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    got = lowering_text(PLANS[name], monkeypatch)
    path = GOLDEN / f"{name}.txt"
    if os.environ.get(UPDATE):
        path.parent.mkdir(exist_ok=True)
        path.write_text(got)
    assert path.exists(), f"{path} is missing; write it with {UPDATE}=1"
    want = path.read_text()
    if got != want:
        diff = "\n".join(difflib.unified_diff(want.splitlines(), got.splitlines(),
                                              f"golden/{name}.txt", "lowered now", lineterm=""))
        pytest.fail(f"the lowering of {name} changed; if intended, rerun with {UPDATE}=1 and "
                    f"review the golden file's diff:\n{diff}", pytrace=False)


@pytest.mark.timeout(120)
def test_rendering_does_not_depend_on_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process under another hash seed renders the same text (sets of strings
    iterate in another order there: a pass that walked one would show here)."""
    name = "llama4_tp2_sp_pp2_dp2_zero3"
    script = ("import sys, pytest; from tests.passes.test_golden_graphs import PLANS, "
              "lowering_text; mp = pytest.MonkeyPatch(); "
              f"sys.stdout.write(lowering_text(PLANS[{name!r}], mp))")
    root = Path(__file__).resolve().parents[2]
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           check=True, cwd=root, timeout=100,
                           env={**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(root)})
    assert other.stdout == lowering_text(PLANS[name], monkeypatch)
