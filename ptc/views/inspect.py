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

from ptc.compiler.graph.meta import get_info
from ptc.compiler.graph.nodes import op_name
from ptc.compiler.records.program import Program
from ptc.views.tables import FitTable, wrap
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


def experts_line(program: Program) -> str:
    """"experts: ep 2, each held by 2 ranks; by ep rank: 0: 0-3, 1: 4-7 (of layers 0-1)" —
    which routed experts each ep rank holds ("" without expert parallelism)."""
    experts = program.decisions.expert_parallel
    if experts is None:
        return ""
    counts = sorted(set(experts.layers.values()))
    layers = sorted(experts.layers)
    if len(counts) != 1:
        return f"experts: ep {experts.ep}; layers {layers} hold {counts} routed experts, 1/ep each"
    local = counts[0] // experts.ep
    held = ", ".join(f"{j}: {j * local}-{(j + 1) * local - 1}" for j in range(experts.ep))
    holders = program.plan.expert_grad_ranks
    return (f"experts: ep {experts.ep}, each held by {holders} rank{'s' * (holders != 1)}; "
            f"by ep rank: {held} (of layers {_runs_text(layers)})")


def _runs_text(numbers: list[int]) -> str:
    """"0-3, 5" for [0, 1, 2, 3, 5]."""
    out, start = [], None
    for i, n in enumerate(numbers):
        start = n if start is None else start
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            out.append(str(n) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)


def render_graph(program: Program, stage: int = 0, fmt: str = "code", *,
                 color: bool = False, width: int = 160) -> str:
    """The stage's lowered graph as text at most `width` columns wide (where a word allows):
    fx's readable code or a table of nodes.

    In "code" every collective's statement carries a comment naming its forward
    and backward communication; in "table" collectives are highlighted (with
    ANSI colours when `color`). Both start with `summary_line`, `overlap_line` and,
    under expert parallelism, `experts_line`.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    gm = stage_graph(program, stage)
    parts = (summary_line(program, stage), overlap_line(program, stage), experts_line(program))
    lines = [line for part in parts if part for line in _comment(part, "", width)]
    head = "\n".join(lines) + "\n"
    if fmt == "code":
        return head + _annotated_code(gm, width)
    console = Console(file=io.StringIO(), width=width, force_terminal=color,
                      color_system="standard" if color else None)
    console.print(_table(gm))
    return head + console.file.getvalue()


def _annotated_code(gm: fx.GraphModule, width: int) -> str:
    notes = {f"{n.name} = ": collective(n) for n in gm.graph.nodes if collective(n)}
    lines = []
    for line in gm.code.splitlines():
        body = line.strip()
        note = next((c for prefix, c in notes.items() if body.startswith(prefix)), None)
        lines += _fold(line, f"COLLECTIVE fwd: {note[0]}; bwd: {note[1]}" if note else "", width)
    return "\n".join(lines).strip("\n") + "\n"


def _comment(text: str, indent: str, width: int) -> list[str]:
    """`text` as `# ` comment lines at `indent`, wrapped at `width` (see `views.wrap`)."""
    return [f"{indent}# {line}" for line in wrap(text, width - len(indent) - 2)]


def _fold(line: str, note: str, width: int) -> list[str]:
    """A line of fx code, with its `note` as a trailing comment, folded to `width`.

    A line that fits stays one line. Otherwise the note becomes a comment above
    it, each `;`-joined statement (fx frees a value's inputs after its last use
    with `a = b = None`) takes a line of its own, and a statement still too wide
    breaks its final call's arguments onto continuation lines. A name or
    literal is never split: one longer than the width stays whole.
    """
    indent = line[:len(line) - len(line.lstrip())]
    whole = f"{line}  # {note}" if note else line
    if len(whole) <= width:
        return [whole]
    out = _comment(note, indent, width) if note else []
    for statement in _top_level(line.strip(), ";"):
        out += _fold_statement(statement.strip(), indent, width)
    return out


def _fold_statement(statement: str, indent: str, width: int) -> list[str]:
    """One statement at `indent`, folded to `width` where it can be: fx's `a = b = None` as
    several shorter ones, anything else at its final brackets (`_fold_brackets`); an
    assignment whose value does not fold within the width gets the value in brackets of
    its own, on the lines below."""
    if len(indent) + len(statement) <= width:
        return [indent + statement]
    if statement.endswith(" = None"):
        return _free_lines(statement.split(" = ")[:-1], indent, width)
    folded = _fold_brackets(statement, indent, width)
    target, _, value = statement.partition(" = ")
    if max(map(len, folded)) <= width or not (value and target.isidentifier()):
        return folded
    return [f"{indent}{target} = (", *_fold_brackets(value, indent + " " * 4, width, ")")]


def _fold_brackets(text: str, indent: str, width: int, suffix: str = "") -> list[str]:
    """`text` + `suffix` at `indent`. Wider than `width` and ending in a bracket, the
    bracket's items go on lines four deeper, packed as many a line as fit; an item still too
    wide folds the same way."""
    opening = _final_bracket(text)
    if len(indent) + len(text) + len(suffix) <= width or opening is None:
        return [indent + text + suffix]
    items = [item.strip() for item in _top_level(text[opening + 1:-1], ",")]
    trailing = len(items) > 1 and not items[-1]  # a one-element tuple's comma: `(a,)`
    items = items[:-1] if trailing else items
    if items == [""]:
        return [indent + text + suffix]
    ends = [","] * (len(items) - 1) + [("," if trailing else "") + text[-1] + suffix]
    inner, lines = indent + " " * 4, [indent + text[:opening + 1]]
    joinable = False  # the last line holds whole items of this bracket: more may join it
    for item, end in zip(items, ends):
        if joinable and len(lines[-1]) + 1 + len(item) + len(end) <= width:
            lines[-1] += f" {item}{end}"
            continue
        folded = _fold_brackets(item, inner, width, end)
        lines += folded
        joinable = len(folded) == 1
    return lines


def _free_lines(names: list[str], indent: str, width: int) -> list[str]:
    """fx's `a = b = ... = None` for `names` as as few such statements of at most `width`
    as they go."""
    groups: list[list[str]] = [[]]
    for name in names:
        wider = [*groups[-1], name]
        if groups[-1] and len(indent + " = ".join(wider) + " = None") > width:
            groups.append([name])
        else:
            groups[-1] = wider
    return [indent + " = ".join(group) + " = None" for group in groups]


def _final_bracket(text: str) -> int | None:
    """Index of the bracket that the bracket ending `text` closes (None when it ends
    otherwise)."""
    if not text or text[-1] not in ")]}":
        return None
    opens = [i for i, ch, depth in _code_chars(text) if ch in "([{" and depth == 0]
    return opens[-1] if opens else None


def _top_level(text: str, sep: str) -> list[str]:
    """`text` split at each `sep` outside brackets and string literals."""
    cuts = [i for i, ch, depth in _code_chars(text) if ch == sep and depth == 0]
    return [text[a + 1:b] for a, b in zip([-1, *cuts], [*cuts, len(text)])]


def _code_chars(text: str):
    """(index, character, brackets open around it) of each character of Python `text` outside
    string literals."""
    quote, depth = "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote and text[i - 1] != "\\" else quote
            continue
        if ch in "'\"":
            quote = ch
            continue
        depth -= ch in ")]}"
        yield i, ch, depth
        depth += ch in "([{"


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
    out = ["digraph lowered {", "  rankdir=TB;",
           '  node [shape=box, fontsize=10, fontname="monospace"];',
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
