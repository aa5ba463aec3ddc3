"""`ptc.views.inspect`: the lowered graph as code, as a table and as Graphviz dot."""

from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repo root on the path
    sys.path.insert(0, str(ROOT))

from ptc.views.inspect import _fold, graph_to_dot, render_graph, summary_line
from ptc.lower.driver import compile_plan  # noqa: E402
from ptc.plan import HardwareSpec, ModelSpec, ParallelSpec, Plan, TrainSpec  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def program():
    plan = Plan(model=ModelSpec(family="gpt", layers=1, hidden=32, heads=4, vocab=64, max_seq=16),
                hardware=HardwareSpec.preset("cpu", gpus_per_node=4),
                parallel=ParallelSpec(tp=2, dp=2, zero=3, sequence_parallel=True),
                train=TrainSpec(seq_len=16, global_batch=4, micro_batch=2, dtype="fp32"))
    return compile_plan(plan)


def gathers(program) -> int:
    """ZeRO-3 gathers after the comm_overlap pass: one per bucket."""
    return len(program.stages[0].overlap.buckets)


# One layer's qkv and MLP input, and the head: each all_gather_seq is fused with its linears.
FUSED = 3
COLLECTIVES = 3 + 1 + 1 + FUSED  # reduce_scatter_seq, scatter_seq, vocab cross-entropy


def test_summary_counts_collectives(program):
    line = summary_line(program)
    assert line.startswith("stage 0: ")
    for part in (f"{FUSED} column_parallel_linears_seq", "3 reduce_scatter_seq", "1 scatter_seq",
                 "1 vocab_parallel_cross_entropy",
                 f"{gathers(program)} gather_params_start", f"{gathers(program)} gather_params,"):
        assert part in line
    assert "all_gather_seq" not in line.replace("column_parallel_linears_seq", "")


def test_code_marks_each_collective_line(program):
    text = render_graph(program, 0, "code", width=1000)  # wide: a statement and note a line
    marked = [line for line in text.splitlines() if "# COLLECTIVE" in line]
    assert len(marked) == COLLECTIVES + 2 * gathers(program)
    gather = next(line for line in marked if "column_parallel_linears_seq(" in line)
    assert gather.endswith("# COLLECTIVE fwd: all-gather; bwd: all-gather again, "
                           "reduce-scatter (async, overlaps weight gradients)")
    assert "def forward(self, tokens" in text


def test_code_folds_to_the_width_and_stays_the_same_python(program):
    """At 80 columns a long statement breaks its call's arguments onto continuation lines,
    fx's frees take lines of their own and a collective's note goes above: the same code."""
    wide, narrow = (render_graph(program, 0, "code", width=w) for w in (1000, 80))
    lines = narrow.splitlines()
    assert max(map(len, lines)) <= 80 < max(map(len, wide.splitlines()))
    assert statements(narrow) == statements(wide)
    assert narrow.count("# COLLECTIVE") == wide.count("# COLLECTIVE")
    call = next(i for i, line in enumerate(lines) if "column_parallel_linears_seq(" in line)
    assert lines[call].endswith("(") and lines[call + 1].startswith(" " * 8)
    note = next(i for i in range(call, 0, -1) if "# COLLECTIVE" in lines[i])
    assert lines[note].strip().startswith("# COLLECTIVE fwd: all-gather; bwd: all-gather again")
    assert all(line.strip().startswith("#   ") for line in lines[note + 1:call])


LONG_LINES = [
    '    model_layers_0_post_attention_layernorm_weight = getattr(self.model.layers, "0")'
    '.post_attention_layernorm.weight',
    "    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default("
    "add_4, reshape, reshape_1, expand_1, scale = 0.25);  add_4 = reshape = reshape_1 = None",
    "    out = op(first_argument_name, (a_weight_of_some_length, b_weight_of_some_length, "
    "c_weight,), label = 'a, (b) = c', axis = 'tp')",
]


@pytest.mark.parametrize("line", LONG_LINES)
def test_a_long_line_folds_to_the_same_statements(line):
    note = "COLLECTIVE fwd: all-reduce; bwd: identity"
    folded = _fold(line, note, 80)
    assert max(map(len, folded)) <= 80 < len(line) and folded[0] == f"    # {note}"
    assert statements(textwrap.dedent("\n".join(folded))) == statements(line.strip())


def statements(code: str) -> list[str]:
    """Each statement of `code`, fx's frees (`a = b = None`) one per name: folding may split
    them over lines."""
    out = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Assign) and ast.dump(node.value) == ast.dump(ast.Constant(None)):
            out += [f"{target.id} = None" for target in node.targets]
        elif isinstance(node, ast.stmt) and not isinstance(node, ast.FunctionDef):
            out.append(ast.dump(node))
    return out


def test_table_lists_every_node_and_highlights_collectives(program):
    gm = program.stages[0].graph
    plain = render_graph(program, 0, "table", width=200)
    assert "fwd reduce-scatter / bwd all-gather" in plain
    assert "layers.0.attn.qkv" in plain
    assert "\x1b[" not in plain
    coloured = render_graph(program, 0, "table", color=True, width=200)
    assert "\x1b[" in coloured
    assert len(gm.graph.nodes) > 50


def test_dot_has_a_node_per_graph_node_and_edges(program):
    gm = program.stages[0].graph
    dot = graph_to_dot(program, 0)
    assert dot.startswith("digraph lowered {") and dot.rstrip().endswith("}")
    for node in gm.graph.nodes:
        assert f'"{node.name}" [label=' in dot
    assert dot.count("fillcolor=\"orange\"") == COLLECTIVES + 2 * gathers(program)
    assert '"column_parallel_linears_seq" -> "layers_0_attn_qkv";' in dot


def test_bad_stage_and_format(program):
    with pytest.raises(ValueError, match="stage 1 does not exist"):
        render_graph(program, 1)
    with pytest.raises(ValueError, match="fmt must be one of"):
        render_graph(program, 0, "svg")


def test_header_states_the_overlap_decisions(program):
    decided = program.stages[0].overlap
    text = render_graph(program, 0, "code", width=1000)  # wide: each header line whole
    line = text.splitlines()[1]
    assert line.startswith(f"# buckets: {len(decided.buckets)} of <= ")
    assert "[" + " ".join(map(str, decided.buckets[0])) + "]" in line
    assert "gathers start 1 ahead, 2 gradient reductions in flight" in line
    # Norm weights and biases, attention-out and MLP-down biases, final norm: summed once.
    assert line.endswith("8 replicated parameter gradients summed over tp once per step")
