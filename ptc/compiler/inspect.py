"""Show a lowered graph with its collectives: readable fx code, a table of nodes, Graphviz dot.

`ptc inspect PLAN [--stage S] [--dot FILE]` prints what one pipeline stage
of a compiled Program runs on every rank of that stage. A *collective* is a
node whose target carries `ptc_collective = (forward, backward)` — the ops
of `ptc.ops.tp_ops` and `ptc.ops.collectives` set it — so this
module recognises them without importing the runtime.
"""

from __future__ import annotations

import io
import math

from rich.console import Console

from torch import fx

from ptc.compiler.meta import get_info
from ptc.compiler.nodes import op_name
from ptc.compiler.program import Program
from ptc.compiler.views import FitTable
from ptc.units import format_bytes

FORMATS = ("code", "table")


def collective(node: fx.Node) -> tuple[str, str] | None:
    """(forward, backward) communication of a collective node, or None for other nodes."""
    if node.op != "call_function":
        return None
    return getattr(node.target, "ptc_collective", None)


def stage_graph(program: Program, stage: int = 0) -> fx.GraphModule:
    """The lowered graph of pipeline `stage` (ValueError naming the valid stages)."""
    if not 0 <= stage < len(program.stages):
        raise ValueError(f"stage {stage} does not exist: the program has stages "
                         f"0..{len(program.stages) - 1}")
    return program.stages[stage].graph


def summary_line(program: Program, stage: int = 0) -> str:
    """"stage 0: 212 nodes; collectives: 5 copy_to_tp, 5 reduce_from_tp, ..." ."""
    gm = stage_graph(program, stage)
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if collective(node):
            counts[op_name(node)] = counts.get(op_name(node), 0) + 1
    listed = ", ".join(f"{n} {name}" for name, n in counts.items()) or "none"
    return f"stage {stage}: {len(gm.graph.nodes)} nodes; collectives: {listed}"


def overlap_line(program: Program, stage: int = 0) -> str:
    """"buckets: 4 of <= 37.1 kB over 5 units: [0 1] [2] [3] [4 0]; ..." — the comm_overlap
    pass's decisions for the stage ("" when the pass did not run)."""
    stage_graph(program, stage)
    decided = program.stages[stage].overlap
    if decided is None:
        return ""
    units = sum(len(b) for b in decided.buckets)
    listed = " ".join("[" + " ".join(map(str, b)) + "]" for b in decided.buckets)
    parts = [f"buckets: {len(decided.buckets)} of <= {format_bytes(decided.bucket_bytes)} over "
             f"{units} units: {listed}"]
    if not decided.overlap:
        parts.append("overlap off: every collective waited for at once")
    else:
        ahead = f"gathers start {decided.prefetch} ahead, " if program.plan.parallel.zero == 3 \
            else ""
        parts.append(f"{ahead}{decided.in_flight} gradient reductions in flight")
    if decided.tp_fused:
        parts.append(f"{decided.tp_fused} tp input-gradient reductions overlap weight gradients")
    tp = program.tensor_parallel
    if tp is not None and tp.partial_grads:
        parts.append(f"{len(tp.partial_grads)} replicated parameter gradients summed "
                     "over tp once per step")
    return "; ".join(parts)


def render_graph(program: Program, stage: int = 0, fmt: str = "code", *,
                 color: bool = False, width: int = 160) -> str:
    """The stage's lowered graph as text: fx's readable code or a table of nodes.

    In "code" every collective's line ends with a comment naming its forward
    and backward communication; in "table" collectives are highlighted (with
    ANSI colours when `color`). Both start with `summary_line` and `overlap_line`.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    gm = stage_graph(program, stage)
    head = f"# {summary_line(program, stage)}\n"
    if overlap_line(program, stage):
        head += f"# {overlap_line(program, stage)}\n"
    if fmt == "code":
        return head + _annotated_code(gm)
    console = Console(file=io.StringIO(), width=width, force_terminal=color,
                      color_system="standard" if color else None)
    console.print(_table(gm))
    return head + console.file.getvalue()


def _annotated_code(gm: fx.GraphModule) -> str:
    notes = {f"{n.name} = ": collective(n) for n in gm.graph.nodes if collective(n)}
    lines = []
    for line in gm.code.splitlines():
        body = line.strip()
        note = next((c for prefix, c in notes.items() if body.startswith(prefix)), None)
        if note:
            line = f"{line}  # COLLECTIVE fwd: {note[0]}; bwd: {note[1]}"
        lines.append(line)
    return "\n".join(lines).strip("\n") + "\n"


def _table(gm: fx.GraphModule) -> FitTable:
    table = FitTable()
    for column in ("#", "node", "op", "module", "kind", "shape", "FLOPs", "collective"):
        table.add_column(column, number=column in ("#", "FLOPs"))
    for index, node in enumerate(gm.graph.nodes):
        meta = get_info(node)
        comm = collective(node)
        shape = " ".join(str(tuple(s)) for s in meta.shapes) if meta is not None else ""
        table.add_row(
            str(index), node.name, op_name(node),
            meta.module_path if meta is not None else "", meta.kind if meta is not None else "",
            shape, _flops(meta.flops) if meta is not None and meta.flops else "",
            f"fwd {comm[0]} / bwd {comm[1]}" if comm else "",
            style="bold magenta" if comm else None)
    return table


def _flops(value: int) -> str:
    if value < 1000:
        return str(value)
    exponent = min(int(math.log10(value)) // 3, 4)
    return f"{value / 1000 ** exponent:.3g}{' KMGT'[exponent]}"


def graph_to_dot(program: Program, stage: int = 0) -> str:
    """Graphviz dot text of the stage's graph: one box per node, collectives filled orange."""
    gm = stage_graph(program, stage)
    out = ["digraph lowered {", "  rankdir=TB;", '  node [shape=box, fontsize=10, fontname="monospace"];',
           f'  label="{_escape(summary_line(program, stage))}"; labelloc=t;']
    for node in gm.graph.nodes:
        meta = get_info(node)
        label = [node.name, op_name(node)]
        if meta is not None and meta.shapes:
            label.append(" ".join(str(tuple(s)) for s in meta.shapes))
        comm = collective(node)
        attrs = ""
        if comm:
            label.append(f"fwd {comm[0]} / bwd {comm[1]}")
            attrs = ', shape=ellipse, style=filled, fillcolor="orange"'
        elif node.op in ("placeholder", "output"):
            attrs = ', shape=oval, style=filled, fillcolor="lightblue"'
        elif node.op == "get_attr":
            attrs = ', style=filled, fillcolor="lightgrey"'
        out.append(f'  "{node.name}" [label="{_escape(chr(10).join(label))}"{attrs}];')
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            out.append(f'  "{arg.name}" -> "{node.name}";')
    out.append("}")
    return "\n".join(out) + "\n"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
