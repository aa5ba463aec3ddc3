"""`ptc report`: one self-contained HTML page of what the compiler did and predicts.

The page holds, each drawn with matplotlib as inline SVG (nothing to fetch):

- the plan in one table: model, layout, predicted step time, MFU, memory;
- the pipeline schedule as a per-rank Gantt chart (forward and backward of
  every micro-batch at each unit step; gaps are the bubble);
- per-stage memory as stacked bars (weights, gradients, optimizer state,
  activations, ...) against the HBM and the budget (HBM less memory_margin),
  and the same bytes in a table, where a term a larger one dwarfs is read;
- the step-time breakdown (compute, recompute, communication, bubble, optimizer);
- the pass log, each pass named in words, and each stage's lowered graph as a
  picture: every collective coloured by its op and named, each layer's first
  node and the stage's inputs and outputs labelled, every node's name, op and
  layer shown on hover; its code folded under it.

Only presentation lives here: the numbers are the estimate's and the Program's.
"""

from __future__ import annotations

import html
import io
import re

import matplotlib
import networkx as nx
from matplotlib.figure import Figure
from torch import fx

from ptc.compiler.graph.meta import KEY as META_KEY
from ptc.compiler.graph.nodes import op_name
from ptc.views.inspect import collective, stage_graph
from ptc.compiler.memory.model import TERMS
from ptc.compiler.records.program import Program
from ptc.views.explain import PARTS
from ptc.compiler.schedule.build import schedule_for
from ptc.compiler.schedule.simulation import simulate
from ptc.units import format_bytes, format_seconds

FORWARD, BACKWARD = "#2a9d8f", "#e76f51"
INPUT_GRADIENTS, WEIGHT_GRADIENTS = "#f4a261", "#8d5fd3"
ACTION_COLOURS = {"F": (FORWARD, "forward"), "B": (BACKWARD, "backward"),
                  "I": (INPUT_GRADIENTS, "input gradients (I)"),
                  "W": (WEIGHT_GRADIENTS, "weight gradients (W)")}
"""Each compute kind's colour and name in the schedule's picture."""
"""Colours of forward and backward actions in the schedule chart."""
PALETTE = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3",
           "#8c8c8c", "#ccb974", "#64b5cd", "#2f4b7c")
"""Colours of memory terms and step-time parts, in order."""
BUDGET = "#c00000"
"""Colour of the memory budget's line."""
COLLECTIVES = ("#d62fd6", "#e6550d", "#3182bd", "#31a354", "#756bb1", "#e7298a", "#a6761d",
               "#666666")
"""Colours of the collective ops in the graph pictures, one per op (the last for the rest)."""
NODE_COLOURS = {"placeholder": "#55a868", "output": "#c44e52", "get_attr": "#b9a88f",
                "compute": "#9ab0d6"}
"""Colours of the other nodes in the graph pictures."""
MAX_LABELLED_NODES = 40
"""Graphs up to this many nodes get every node's name written on the picture."""
PASS_TITLES = {
    "shard_tensors_pass": "Tensor parallelism",
    "shard_sequence_pass": "Sequence parallelism",
    "split_context_pass": "Context parallelism",
    "quantize_gemms_pass": "float8 GEMMs",
    "checkpoint_layers_pass": "Activation checkpointing",
    "split_pipeline_pass": "Pipeline split",
    "stamp_layers_pass": "Layers stamped out",
    "shard_params_pass": "ZeRO-3 gathers",
    "overlap_collectives_pass": "Communication overlap",
}
"""Each pass's name in words, for the pass log."""


def render_report(program: Program) -> str:
    """The HTML page of a compiled Program (the module docstring)."""
    plan = program.plan
    est = program.decisions.estimate
    parts = [f"<h1>ptc report: {html.escape(plan.source)}</h1>", _summary(program)]
    if plan.parallel.pp > 1:
        schedule = getattr(program, "schedule", None) or schedule_for(plan)
        parts.append(_figure("Pipeline schedule", _gantt(schedule), "schedule"))
    if est is not None:
        parts.append(_figure("Memory per pipeline stage", _memory(est), "memory"))
        parts.append(_memory_table(est))
        parts.append(_figure("Where the step time goes", _breakdown(est), "time"))
    else:
        parts.append(f"<p>No predictions: {html.escape(program.decisions.unpriced or '')}</p>")
    parts.append("<h2>Passes</h2><ol id=\"passes\">" + "".join(
        f"<li>{_pass_line(line)}</li>" for line in program.pass_log) + "</ol>")
    stages = len(program.stages)
    for stage in range(stages):
        gm = stage_graph(program, stage)
        figure, names = _graph_picture(gm, stage, stages)
        parts.append(_with_titles(
            _figure(f"Stage {stage}: lowered graph ({len(gm.graph.nodes)} nodes)", figure,
                    f"stage{stage}"), f"ptc-nodes-{stage}", names))
        parts.append(f"<details><summary>stage {stage} code</summary><pre>"
                     f"{html.escape(gm.code)}</pre></details>")
    return _PAGE.format(title=html.escape(f"ptc report: {plan.source}"), body="\n".join(parts))


def _summary(program: Program) -> str:
    plan, est = program.plan, program.decisions.estimate
    p = plan.parallel
    rows = [("model", plan.model.factory if plan.model.family == "custom" else
             f"{plan.model.family}: {plan.model.layers} layers, hidden {plan.model.hidden}"),
            ("hardware", f"{plan.num_gpus} x {plan.hardware.gpu}"),
            ("layout", f"tp {p.tp}, " + (f"cp {p.cp}, " if p.cp != 1 else "")
                       + f"pp {p.pp}, dp {p.dp}, ZeRO {p.zero}"
                       + (", sequence parallel" if p.sequence_parallel else "")
                       + f", {plan.num_microbatches} micro-batches of {plan.train.micro_batch}"),
            ("dtype", plan.train.dtype)]
    if est is not None:
        rows += [("predicted step time", format_seconds(est.step_time_s)),
                 ("tokens/s", f"{est.tokens_per_s:,.0f}"), ("MFU", f"{est.mfu:.1%}"),
                 ("peak memory", f"{format_bytes(est.peak_memory_bytes)} of a "
                                 f"{format_bytes(est.budget_bytes)} budget"
                                 + ("" if est.fits else " (does not fit)"))]
    return "<table id=\"summary\">" + "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows) + \
        "</table>"


def _gantt(schedule) -> Figure:
    """Each rank's compute actions over the unit steps of the schedule."""
    timeline = simulate(schedule)
    fig = Figure(figsize=(11, 0.5 + 0.45 * schedule.pp), layout="constrained")
    ax = fig.add_subplot()
    kinds = [k for k in ACTION_COLOURS if any(a.kind == k for row in schedule.ranks for a in row)]
    for rank in range(schedule.pp):
        for kind in kinds:
            colour = ACTION_COLOURS[kind][0]
            spans = _runs([t for t, row in enumerate(timeline.steps)
                           if row[rank] is not None and row[rank].kind == kind])
            ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=colour)
        if len(timeline.steps) <= 64:
            for t, row in enumerate(timeline.steps):
                if row[rank] is not None:
                    ax.text(t + 0.5, rank, str(row[rank].microbatch), ha="center",
                            va="center", fontsize=7, color="white")
    ax.set_yticks(range(schedule.pp), [f"rank {r}" for r in range(schedule.pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, len(timeline.steps))
    ax.set_xlabel(f"unit step ({schedule.kind}, {schedule.microbatches} micro-batches, "
                  f"bubble {timeline.bubble:.0%})")
    fig.legend(handles=[_patch(*ACTION_COLOURS[k]) for k in kinds],
               loc="outside right upper", fontsize=8)
    return fig


def _runs(steps: list[int]) -> list[tuple[int, int]]:
    """Consecutive unit steps as (start, length) bars."""
    runs: list[list[int]] = []
    for t in steps:
        if runs and runs[-1][0] + runs[-1][1] == t:
            runs[-1][1] += 1
        else:
            runs.append([t, 1])
    return [(start, length) for start, length in runs]


def _memory(est) -> Figure:
    """Stacked bars of each stage's memory terms, with the budget and the HBM as lines."""
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.add_subplot()
    stages = range(len(est.memory_terms))
    bottom = [0.0] * len(est.memory_terms)
    gib = 2.0 ** 30
    for term, colour in zip(TERMS, PALETTE):
        values = [terms[term] / gib for terms in est.memory_terms]
        ax.bar(stages, values, bottom=bottom, color=colour, label=term, width=0.6)
        bottom = [b + v for b, v in zip(bottom, values)]
    top = max(bottom, default=0.0)
    if top * 3 < est.budget_bytes / gib:  # the bars would be slivers under the lines
        ax.set_ylim(0, top * 1.25 or 1.0)
        ax.plot([], [], " ", label=f"HBM {format_bytes(est.hbm_bytes)}, budget "
                                    f"{format_bytes(est.budget_bytes)}: above the chart")
    else:
        ax.axhline(est.hbm_bytes / gib, color="black", linewidth=1,
                   label=f"HBM {format_bytes(est.hbm_bytes)}")
        ax.axhline(est.budget_bytes / gib, color=BUDGET, linestyle="--", linewidth=2.5,
                   label=f"budget {format_bytes(est.budget_bytes)}")
    ax.set_xticks(list(stages), [f"stage {s}" for s in stages])
    ax.set_ylabel("GiB per GPU (most loaded rank)")
    fig.legend(fontsize=8, loc="outside right upper")
    return fig


def _breakdown(est) -> Figure:
    """The step time as one horizontal bar, split by part."""
    fig = Figure(figsize=(9, 2.4), layout="constrained")
    ax = fig.add_subplot()
    left = 0.0
    for part, colour in zip(PARTS, PALETTE):
        seconds = float(est.breakdown[part])
        share = seconds / est.step_time_s
        ax.barh(0, seconds, left=left, color=colour,
                label=f"{part} {format_seconds(seconds)} ({share:.1%})")
        left += seconds
    ax.set_yticks([])
    ax.set_xlabel(f"seconds per step (predicted {format_seconds(est.step_time_s)})")
    fig.legend(fontsize=8, ncol=4, loc="outside lower center")
    return fig


def _pass_line(line: str) -> str:
    """A pass log line as HTML, the pass named in words ("Tensor parallelism: inserted ...")."""
    name, sep, rest = line.partition(": ")
    title = PASS_TITLES.get(name)
    if not sep or title is None:
        return html.escape(line)
    return f"<b>{html.escape(title)}</b> <small>({html.escape(name)})</small>: " \
           f"{html.escape(rest)}"


def _memory_table(est) -> str:
    """The memory terms of each stage in bytes, as a table (small terms stay readable)."""
    head = "".join(f"<th>stage {s}</th>" for s in range(len(est.memory_terms)))
    rows = "".join(
        f"<tr><th>{html.escape(term)}</th>" + "".join(
            f"<td>{format_bytes(terms[term])}</td>" for terms in est.memory_terms) + "</tr>"
        for term in TERMS if any(terms[term] for terms in est.memory_terms))
    total = "".join(f"<td><b>{format_bytes(sum(terms.values()))}</b></td>"
                    for terms in est.memory_terms)
    return f"<table id=\"memory-terms\"><tr><th></th>{head}</tr>{rows}" \
           f"<tr><th>total</th>{total}</tr></table>"


def _node_kind(node: fx.Node) -> str:
    """A node's kind in the picture: its op's name for a collective, else its fx op."""
    if collective(node):
        return op_name(node)
    return node.op if node.op in NODE_COLOURS else "compute"


def _graph_picture(gm: fx.GraphModule, stage: int, stages: int
                   ) -> tuple[Figure, list[str]]:
    """The graph drawn left to right by dependency depth, and each drawn node's hover text
    in drawing order (`_with_titles`): collectives coloured by op and named, each layer's
    first node and the stage's ends labelled."""
    graph = nx.DiGraph()
    for node in gm.graph.nodes:
        graph.add_node(node.name)
        graph.add_edges_from((source.name, node.name) for source in node.all_input_nodes)
    for depth, names in enumerate(nx.topological_generations(graph)):
        for name in names:
            graph.nodes[name]["depth"] = depth
    depth = max((d for _, d in graph.nodes(data="depth")), default=0) + 1
    positions = nx.multipartite_layout(graph, subset_key="depth")
    fig = Figure(figsize=(min(40, max(8, depth * 0.18)), 5), layout="constrained")
    ax = fig.add_subplot()
    ax.set_axis_off()
    nodes = {node.name: node for node in gm.graph.nodes}
    kinds = {name: _node_kind(node) for name, node in nodes.items()}
    ops = sorted({k for k in kinds.values() if k not in NODE_COLOURS},
                 key=lambda k: -sum(v == k for v in kinds.values()))
    colours = dict(NODE_COLOURS) | {
        op: COLLECTIVES[min(i, len(COLLECTIVES) - 1)] for i, op in enumerate(ops)}
    nx.draw_networkx_edges(graph, positions, ax=ax, width=0.4, alpha=0.5, arrows=False)
    order = list(graph.nodes)
    drawn = nx.draw_networkx_nodes(graph, positions, ax=ax, nodelist=order, node_size=[
        60 if kinds[n] in ops else 14 for n in order],
        node_color=[colours[kinds[n]] for n in order])
    drawn.set_gid(f"ptc-nodes-{stage}")
    nx.draw_networkx_labels(graph, positions, ax=ax, font_size=5,
                            labels=_labels(nodes, kinds, ops, stage, stages))
    counts = {k: sum(v == k for v in kinds.values()) for k in ops}
    fig.legend(handles=[_patch(colours[op], f"{op} x{counts[op]}") for op in ops]
               + [_patch(NODE_COLOURS["compute"], "compute"),
                  _patch(NODE_COLOURS["placeholder"], "input"),
                  _patch(NODE_COLOURS["output"], "output")],
               loc="outside right upper", fontsize=8)
    return fig, [_hover(nodes[n], kinds[n]) for n in order]


def _labels(nodes: dict[str, fx.Node], kinds: dict[str, str], ops: list[str], stage: int,
            stages: int) -> dict[str, str]:
    """What is written beside the nodes: every name in a small graph; else each collective's
    op, each layer's first node and the stage's inputs and outputs."""
    if len(nodes) <= MAX_LABELLED_NODES:
        return {name: name for name in nodes}
    labels, layers = {}, set()
    for name, node in nodes.items():
        layer = getattr(node.meta.get(META_KEY), "layer", None)
        if kinds[name] in ops:
            labels[name] = kinds[name]
        elif layer is not None and layer not in layers:
            labels[name] = f"layer {layer}"
        elif node.op == "placeholder" and node.name == next(iter(nodes)):
            labels[name] = f"from stage {stage - 1}" if stage else "inputs"
        elif node.op == "output":
            labels[name] = f"to stage {stage + 1}" if stage + 1 < stages else "loss"
        if layer is not None:
            layers.add(layer)
    return labels


def _hover(node: fx.Node, kind: str) -> str:
    """A node's hover text: its name, op and target, and its layer."""
    layer = getattr(node.meta.get(META_KEY), "layer", None)
    target = op_name(node) if node.op == "call_function" else str(node.target)
    where = f", layer {layer}" if layer is not None else ""
    return f"{node.name}: {kind} {target}{where}"


def _with_titles(section: str, gid: str, titles: list[str]) -> str:
    """`section`'s SVG with a hover title on each marker of the collection `gid` (drawn in
    the order of `titles`): matplotlib writes one <use> or <path> per marker inside its
    group."""
    start = section.find(f'<g id="{gid}"')
    if start < 0:
        return section
    end = section.index("</g>", start)
    group, count = section[start:end], iter(titles)
    marked = re.sub(r"<(use|path) ([^>]*?)/>", lambda m: f"<{m.group(1)} {m.group(2)}>"
                    f"<title>{html.escape(next(count, ''))}</title></{m.group(1)}>", group)
    return section[:start] + marked + section[end:]


def _patch(colour: str, label: str):
    from matplotlib.patches import Patch  # noqa: PLC0415 - with the figures

    return Patch(color=colour, label=label)


def _figure(title: str, fig: Figure, anchor: str) -> str:
    """A section with the figure as inline SVG."""
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": "ptc"}):  # the same page every time
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    svg = buffer.getvalue()
    svg = svg[svg.index("<svg"):]
    return f"<h2 id=\"{anchor}\">{html.escape(title)}</h2><div class=\"figure\">{svg}</div>"


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; color: #222; background: #fff; }}
table {{ border-collapse: collapse; }} th, td {{ padding: 2px 12px; text-align: left; }}
th {{ color: #555; font-weight: normal; }}
.figure svg {{ max-width: 100%; height: auto; }}
pre {{ font-size: 11px; overflow-x: auto; background: #f6f6f6; padding: 1em; }}
</style></head>
<body>
{body}
</body></html>
"""
