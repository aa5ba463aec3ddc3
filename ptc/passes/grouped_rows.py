"""Follow a rank's token rows through their grouping by expert (context parallelism).

A mixture-of-experts layer computes each token's output from that token
alone, but on the way it reorders the token rows (transformers' grouped_mm
experts, and routers written like them): it sorts the (token, choice) pairs
by expert id, gathers their rows in that order, counts the rows of each
expert (`histc`) into the offsets of grouped products, and puts the rows
back with the inverse of the sort's order. The sort and the count each mix
positions, yet together they are per-token: on any set of positions (a cp
rank's chunks) the layer gives those positions' outputs. `row_groupings`
tells this apart from real mixing by giving each node of such a grouping its
part in it (`Part`), or refusing in one line a use it cannot follow.

Terms, for a *sort* (a sort or argsort of a 1-d tensor split over the
sequence, the flattened pairs):
- *rows*: a tensor whose dim 0 holds the rank's rows in the sort's order;
- *order*: the sort's indices, the position each row came from; *sources*:
  the order floor-divided (the token of each (token, choice) pair);
- *inverse*: the order's inverse permutation, which puts rows back;
- *counts*: a per-rank count of the rows of each group (not split), fit
  only as the offsets of grouped products of the rows.
Rows enter the grouping through the sort's values or a gather by its order
or sources, stay rows through ops that keep each row apart (pointwise,
per-row linears, a gather of a whole table by row keys, grouped products
with the counts as offsets), and leave it through a gather by the inverse
or an `index_add` at the sources (each token's choices summed). The inverse
written as transformers writes it spells out the whole sequence's number of
rows: `invert_permutations` makes it an argsort first.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from enum import Enum

import torch
from torch import fx

from ptc.compiler.graph.meta import copy_meta
from ptc.compiler.graph.nodes import CAST_OPS, GROUPED_MM_OPS, op_name, where
from ptc.errors import CompileError
from ptc.passes.local_shapes import Propagation, is_shape_only, shape_of

_SORTS = frozenset({"sort", "argsort"})
COUNT_OPS = frozenset({"histc", "bincount"})
"""Ops that count the values of a tensor: a sum over its positions."""
_INDEX_PUTS = frozenset({"index_put", "index_put_"})
_INDEX_ADDS = frozenset({"index_add", "index_add_"})


class Role(Enum):
    """What a node holds in a grouping (module docstring)."""

    SORTED = "the values and indices of"
    ROWS = "rows in the order of"
    ORDER = "the order of"
    SOURCES = "the source rows of"
    INVERSE = "the inverse order of"
    COUNTS = "the per-group counts of the rows of"


_INDICES = (Role.ORDER, Role.SOURCES)
"""Roles whose values say which row each row came from."""


@dataclass(frozen=True)
class Part:
    """A node's part in the grouping `sort` makes."""

    sort: fx.Node
    role: Role
    indexes: int = 0
    """Order, sources, inverse: the rows (before the split) of what their values index."""

    def __str__(self) -> str:
        return f"{self.role.value} {self.sort.name}"


def invert_permutations(gm: fx.GraphModule) -> int:
    """Write `inverse = empty_like(order); inverse[order] = arange(n)` as `argsort(order)`,
    where `order` is a sort's indices; return how many.

    Both are the inverse permutation, but the first spells out the number of rows n,
    the whole sequence's at capture: on a cp rank's rows it would not fit. Run on the
    whole graph, before the sequence is split.
    """
    count = 0
    for node in list(gm.graph.nodes):
        order = _inverted_order(node)
        if order is None:
            continue
        scratch, values = node.args[0], node.args[2]
        with gm.graph.inserting_before(node):
            inverse = gm.graph.call_function(torch.ops.aten.argsort.default, (order,))
        copy_meta(node, inverse)
        node.replace_all_uses_with(inverse)
        for dead in (node, scratch, values):
            if not dead.users:
                gm.graph.erase_node(dead)
        count += 1
    return count


def _inverted_order(node: fx.Node) -> fx.Node | None:
    """The sort indices `node` inverts (`invert_permutations`), else None."""
    if op_name(node) not in _INDEX_PUTS or len(node.args) < 3:
        return None
    scratch, indices, values = node.args[:3]
    if not isinstance(indices, (list, tuple)) or len(indices) != 1:
        return None
    order = indices[0]
    if not _is_sort_order(order) or op_name(scratch) != "empty_like" or \
            scratch.args[0] is not order or set(scratch.users) != {node}:
        return None
    length = (shape_of(order) or (None,))[0]
    if op_name(values) != "arange" or values.args != (length,) or len(values.users) != 1:
        return None
    return order


def _is_sort_order(node) -> bool:
    """Whether `node` is a sort's indices (argsort's result, or item 1 of sort's)."""
    if not isinstance(node, fx.Node):
        return False
    if op_name(node) == "argsort":
        return True
    return node.target is operator.getitem and node.args[1] == 1 and \
        op_name(node.args[0]) == "sort"


def row_groupings(gm: fx.GraphModule, prop: Propagation) -> dict[fx.Node, Part]:
    """Each node's part in a grouping of split rows, in graph order; a CompileError
    names a node that uses a grouping's rows, order or counts otherwise."""
    parts: dict[fx.Node, Part] = {}
    for node in gm.graph.nodes:
        part = _Step(node, parts, prop).part()
        if part is not None:
            parts[node] = part
    return parts


def groups_rows(node: fx.Node, parts: dict[fx.Node, Part]) -> bool:
    """Whether `node` sorts, counts or inverts rows for a grouping: each mixes the rank's
    positions, but only to put rows in order and back."""
    part = parts.get(node)
    return part is not None and (part.sort is node or part.role in (Role.INVERSE, Role.COUNTS))


class _Step:
    """The part of one node, from its inputs' parts and its op."""

    def __init__(self, node: fx.Node, parts: dict[fx.Node, Part], prop: Propagation):
        self.node, self.prop, self.name = node, prop, op_name(node)
        self.inputs = {a: parts[a] for a in node.all_input_nodes if a in parts}
        self.sort: fx.Node | None = None  # the grouping the inputs take part in
        self.length = 0  # its rows, before the split

    def part(self) -> Part | None:
        """The node's part (None: none, or rows back in position order); a CompileError
        when it uses a grouping other than the module docstring says."""
        if not self.inputs:
            return self._sort()
        sorts = {p.sort for p in self.inputs.values()}
        if len(sorts) > 1:
            raise self._refuse("mixes the groupings of several sorts")
        if is_shape_only(self.node):
            return None
        self.sort = sorts.pop()
        self.length = self.prop.before[self.sort.args[0]][0][0]
        part = self._follow()
        if part is False:
            raise self._refuse()
        return part

    def _sort(self) -> Part | None:
        """A sort of split 1-d values starts a grouping."""
        x = self.node.args[0] if self.name in _SORTS and self.node.args else None
        if not isinstance(x, fx.Node) or not self.prop.is_split(x) or len(shape_of(x) or ()) != 1:
            return None
        if self.name == "sort":
            return Part(self.node, Role.SORTED)
        return Part(self.node, Role.ORDER, indexes=self.prop.before[x][0][0])

    def _follow(self):
        """The node's part (None: rows back in position order), or False: not followed."""
        node, args = self.node, self.node.args
        role = self._role_of
        if node.target is operator.getitem and role(args[0]) is Role.SORTED:
            return self._as(Role.ROWS) if args[1] == 0 else \
                self._as(Role.ORDER, indexes=self.length)
        if self.name in ("floor_divide", "floordiv") and role(args[0]) in _INDICES:
            return self._sources(args[1])
        if self.name == "argsort" and role(args[0]) is Role.ORDER:
            return self._as(Role.INVERSE, indexes=self.length)
        if _row_index(node)[0] is not None:
            return self._gather()
        if self.name in _INDEX_ADDS:
            return self._scatter_back()
        if self.name in COUNT_OPS and role(args[0]) is Role.ROWS:
            return self._as(Role.COUNTS)
        roles = {p.role for p in self.inputs.values()}
        if roles == {Role.COUNTS} and (self.name in CAST_OPS or self.name == "cumsum"):
            return self._as(Role.COUNTS)
        if self.name in GROUPED_MM_OPS:
            return self._grouped_product()
        if roles == {Role.ROWS} and self._keeps_rows():
            return self._as(Role.ROWS)
        return False

    def _role_of(self, arg) -> Role | None:
        part = self.inputs.get(arg) if isinstance(arg, fx.Node) else None
        return None if part is None else part.role

    def _sources(self, k):
        """order // k: the source row of each of the k rows taken from one (a token's k
        choices)."""
        indexes = self.inputs[self.node.args[0]].indexes
        if not isinstance(k, int) or k < 1 or indexes % k:
            return False
        return self._as(Role.SOURCES, indexes=indexes // k)

    def _gather(self):
        """x[index] along dim 0: rows by the sort's order or sources, a whole table by
        the rows' keys, or the rows back by the inverse."""
        x, index = _row_index(self.node)
        held, by = self._role_of(x), self._role_of(index)
        if held is None and by in _INDICES and self._indexes_rows_of(index, x):
            return self._as(Role.ROWS)
        if held is None and by is Role.ROWS and not self.prop.is_split(x):
            return self._as(Role.ROWS)
        if held is Role.ROWS and by is Role.INVERSE:
            return None
        return False

    def _scatter_back(self):
        """target.index_add(0, order or sources, rows): the rows added back at the
        positions they came from (each token's choices summed)."""
        target, dim, index, source = (list(self.node.args) + [None] * 4)[:4]
        if dim == 0 and self._role_of(target) is None and self._role_of(index) in _INDICES \
                and self._role_of(source) is Role.ROWS and self._indexes_rows_of(index, target):
            return None
        return False

    def _grouped_product(self):
        """grouped_mm(rows, stack, offsets): the rows by expert, the counts as offsets."""
        rows, _, offsets = (list(self.node.args) + [None] * 3)[:3]
        offsets = self.node.kwargs.get("offs", offsets)
        if self._role_of(rows) is Role.ROWS and self._role_of(offsets) is Role.COUNTS and \
                set(self.inputs) <= {rows, offsets}:
            return self._as(Role.ROWS)
        return False

    def _indexes_rows_of(self, index: fx.Node, x) -> bool:
        """Whether the values of `index` are rows of `x`: x is split on dim 0, as long as
        the rows they index."""
        return isinstance(x, fx.Node) and self._split_on(x, 0) and \
            self.prop.before[x][0][0] == self.inputs[index].indexes

    def _keeps_rows(self) -> bool:
        """Whether the node computes each row from the same row of its inputs: every split
        input holds the grouping's rows, and every output as many, on dim 0."""
        split = [a for a in self.node.all_input_nodes if self.prop.is_split(a)]
        return all(a in self.inputs for a in split) and self._split_on(self.node, 0) and \
            all(shape and shape[0] == self.length for shape in self.prop.before[self.node])

    def _split_on(self, x: fx.Node, dim: int) -> bool:
        """Whether each output of `x` is split on `dim` alone."""
        pairs = list(zip(self.prop.before.get(x, ()), self.prop.local.get(x, ())))
        return bool(pairs) and all(
            len(b) > dim and b[dim] != s[dim] and b[:dim] + b[dim + 1:] == s[:dim] + s[dim + 1:]
            for b, s in pairs)

    def _as(self, role: Role, indexes: int = 0) -> Part:
        return Part(self.sort, role, indexes)

    def _refuse(self, why: str = "") -> CompileError:
        used = ", ".join(f"{a.name} ({p})" for a, p in self.inputs.items())
        why = why or f"uses {used} other than to group rows and put them back"
        return CompileError(
            f"context parallelism: {where(self.node)} {why}; cp follows token rows grouped "
            "by a sort of the sequence (gathers by the sort's indices, per-row ops, per-group "
            "counts as the offsets of grouped products, the rows put back by the inverse order "
            "or added back by index_add), each rank grouping its own positions")


def _row_index(node: fx.Node) -> tuple[fx.Node | None, fx.Node | None]:
    """(x, index) of `x[index]` along dim 0 (aten's index, Python's getitem), else Nones."""
    if op_name(node) not in ("index", "getitem") or len(node.args) < 2 or \
            not isinstance(node.args[0], fx.Node):
        return None, None
    x, index = node.args[:2]
    if op_name(node) == "index" and isinstance(index, (list, tuple)) and len(index) == 1:
        index = index[0]
    return (x, index) if isinstance(index, fx.Node) else (None, None)
