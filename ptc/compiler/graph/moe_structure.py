"""Find the routed experts of mixture-of-experts layers in a captured graph, from the graph alone.

A grouped product `grouped_mm(x, W, offs)` (`nodes.GROUPED_MM_OPS`) multiplies
the rows of `x` in group i — rows offs[i-1] .. offs[i], the rows routed to
expert i — by `W[i]`: its operands already say which expert each row goes
to, whatever router chose them (softmax or sigmoid top-k, grouped top-k with
a correction bias, a sparse mixer). So expert parallelism needs no router
pattern: an *expert block* is the grouped products that share one `offs`,
and what lies between the first and the last of them.

Terms:
- the *rows*: the token rows the first product reads, in expert order;
- the *body*: the nodes on a path from a product to the last one (the
  products — a fused gate_up, or separate gate and up products of the same
  rows — the activation, the gate-times-up, per-row biases added);
  every one of them must keep rows apart (a row's output depends on that row
  alone), so the body runs the same on any rows an ep rank receives;
- *stacks*: the parameters the products multiply by, [experts, ., .];
- *row inputs*: other tensors the body reads with one entry per row (a
  per-expert bias gathered by each row's expert id); they travel with the
  rows.

Anything else the body reads, or a body node read outside the block but the
last product, is a structure the pass cannot follow: a CompileError names it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from ptc.compiler.graph.meta import get_info
from ptc.compiler.graph.nodes import (DROPOUT_OPS, GROUPED_MM_OPS, _arg, node_shape, op_name,
                                      param_source, walk, where)
from ptc.errors import CompileError

_ROWWISE_KINDS = frozenset({"pointwise", "activation", "view", "linear"})
"""Node kinds a body may hold, each checked to keep its rows (the first dim) apart."""
_INDEXING_OPS = frozenset({"index", "index_select", "gather", "take", "take_along_dim",
                           "index_put", "index_put_", "scatter", "scatter_", "scatter_add",
                           "scatter_add_", "scatter_reduce", "masked_select", "nonzero",
                           "embedding"})
"""Ops that pick elements by computed positions: refused in a body (`_check_keeps_rows`)."""
_DIM_ARG = {"chunk": 2, "split": 2, "split_with_sizes": 2, "narrow": 1, "slice": 1,
            "select": 1, "cat": 1}
"""Ops that cut or join along one dim: the index of that dim among their arguments."""


@dataclass(frozen=True)
class ExpertBlock:
    """One mixture-of-experts layer's routed experts, as the graph computes them."""

    products: tuple[fx.Node, ...]
    """The grouped products sharing `offsets`, in graph order."""
    rows: fx.Node
    """The token rows the first product reads, grouped by expert."""
    offsets: fx.Node
    """Cumulative row ends per expert (offs[i] = last row of expert i, exclusive)."""
    stacks: tuple[str, ...]
    """Names of the parameters the products multiply by; dim 0 indexes the experts."""
    row_inputs: tuple[fx.Node, ...]
    """Other per-row tensors the body reads (they travel with the rows)."""
    body: frozenset[fx.Node]
    """The nodes from the first product to the last, both included."""
    experts: int
    """Routed experts of the layer (dim 0 of every stack)."""

    @property
    def output(self) -> fx.Node:
        """The last product: its rows go back to the ranks they came from."""
        return self.products[-1]


def find_expert_blocks(gm: fx.GraphModule) -> list[ExpertBlock]:
    """Every expert block of `gm`, in graph order; a CompileError names what cannot be
    followed (a body op that mixes rows, an input the rows cannot carry)."""
    by_offsets: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if op_name(node) in GROUPED_MM_OPS:
            offsets = _arg(node, 2, "offs")
            if not isinstance(offsets, fx.Node):
                raise CompileError(f"expert parallelism: {where(node)} is a grouped product "
                                   "without group offsets: which expert each row goes to "
                                   "cannot be read")
            by_offsets.setdefault(offsets, []).append(node)
    return [_block(products, offsets) for offsets, products in by_offsets.items()]


def _block(products: list[fx.Node], offsets: fx.Node) -> ExpertBlock:
    first, last = products[0], products[-1]
    after = set(walk(products, lambda n: n.users))
    before = set(walk([last], lambda n: n.all_input_nodes))
    body = frozenset(after & before)
    rows = _arg(first, 0, "input")
    count = (node_shape(rows) or (None,))[0]
    stacks: list[str] = []
    row_inputs: list[fx.Node] = []
    for node in sorted(body, key=_order):
        _check_keeps_rows(node, count, products)
        for source in node.all_input_nodes:
            if source in body or source is offsets or \
                    (source is rows and op_name(node) in GROUPED_MM_OPS):
                continue
            if op_name(node) in GROUPED_MM_OPS and source is _arg(node, 1, "weight"):
                stacks.append(_stack(node, source))
            elif (node_shape(source) or (None,))[0] == count and source not in row_inputs:
                row_inputs.append(source)
            elif source not in row_inputs:
                raise CompileError(
                    f"expert parallelism: {where(node)} reads {source.name} "
                    f"{node_shape(source)}, which is neither one of the rows routed to the "
                    f"experts ({count} rows) nor an expert stack; this router's experts cannot "
                    f"be sharded (parallel.ep = 1 keeps every expert on every rank)")
        for user in node.users:
            if user not in body and node is not last:
                raise CompileError(
                    f"expert parallelism: {where(user)} reads {node.name} from inside the "
                    f"experts (between {first.name} and {last.name}): only the last grouped "
                    f"product's rows can go back to their ranks")
    experts = {_experts(products[0], name) for name in stacks}
    if len(experts) != 1:
        raise CompileError(f"expert parallelism: the grouped products {[p.name for p in products]}"
                           f" multiply by stacks of different expert counts {sorted(experts)}")
    return ExpertBlock(products=tuple(products), rows=rows, offsets=offsets,
                       stacks=tuple(dict.fromkeys(stacks)), row_inputs=tuple(row_inputs),
                       body=body, experts=experts.pop())


def _order(node: fx.Node) -> int:
    return list(node.graph.nodes).index(node)


def _check_keeps_rows(node: fx.Node, count: int | None, products: list[fx.Node]) -> None:
    """A body node must compute each row from that row alone: no reduction, reshape or
    indexing across the rows (an index computed on the sending rank means nothing on the
    receiving one), no dropout (its masks are drawn per sample, and rows change rank)."""
    info = get_info(node)
    kind = info.kind if info is not None else "other"
    shapes = info.shapes if info is not None else ()
    name = op_name(node)
    fine = node in products or (kind in _ROWWISE_KINDS and name not in DROPOUT_OPS
                                and name not in _INDEXING_OPS
                                and not (name == "getitem" and len(node.all_input_nodes) > 1)
                                and all(s and s[0] == count for s in shapes))
    if name in _DIM_ARG:
        index = _DIM_ARG[name]
        dim = node.args[index] if len(node.args) > index else node.kwargs.get("dim", 0)
        fine = fine and isinstance(dim, int) and dim not in (0, -len(shapes[0]) if shapes else 0)
    if not fine:
        raise CompileError(
            f"expert parallelism: {where(node)} sits between the experts' grouped products and "
            f"does not keep the routed rows apart ({kind}); the rows an ep rank receives would "
            f"compute something else (parallel.ep = 1 keeps every expert on every rank)")


def _stack(product: fx.Node, operand: fx.Node) -> str:
    name = param_source(operand)
    if name is None:
        raise CompileError(f"expert parallelism: {where(product)} multiplies by "
                           f"{operand.name}, which is not a stack of expert weights (a parameter)")
    return name


def _experts(product: fx.Node, stack: str) -> int:
    owner = product.graph.owning_module
    return int(owner.get_parameter(stack).shape[0])
