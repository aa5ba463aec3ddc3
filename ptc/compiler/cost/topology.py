"""Which link each mesh axis uses, from the mesh order and the node size.

A *group* of an axis is the set of ranks that differ only in that axis's
coordinate. Ranks are numbered with the innermost axis of `order` varying
fastest (tp innermost by default), and rank r sits on node r // gpus_per_node.
So an axis's group members are `stride` ranks apart, where stride is the
product of the degrees of the axes inside it; a group stays inside one node
when stride · size <= gpus_per_node and otherwise spans nodes, with
`per_node` members on each node it touches. A spanning group's collectives
use both links (NVLink inside each node, InfiniBand across), see `comm`.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil


@dataclass(frozen=True, slots=True)
class AxisGroup:
    """Placement of one group of a mesh axis on the nodes."""

    axis: str
    """"tp", "cp", "dp", "pp", or "grad" (dp·cp)."""
    size: int
    """Ranks in the group (the axis degree)."""
    stride: int
    """Distance between consecutive members' global ranks."""
    per_node: int
    """Members of the group that share one node."""

    @property
    def nodes(self) -> int:
        """Nodes one group touches."""
        return ceil(self.size / self.per_node)

    @property
    def spans_nodes(self) -> bool:
        """True when the group's traffic crosses the inter-node link."""
        return self.nodes > 1

    @property
    def link(self) -> str:
        """"intra" (NVLink only) or "inter" (some traffic over InfiniBand)."""
        return "inter" if self.spans_nodes else "intra"


def axis_placements(degrees: dict[str, int], order: tuple[str, ...],
                gpus_per_node: int) -> dict[str, AxisGroup]:
    """Placement of every mesh axis, innermost first in `order` (an axis missing from
    `degrees` has degree 1), and of "grad": the dp·cp ranks gradients are reduced over."""
    groups: dict[str, AxisGroup] = {}
    stride = 1
    for axis in order:
        size = degrees.get(axis, 1)
        # Members `stride` apart: gpus_per_node // stride of them fit in a node.
        per_node = 1 if stride >= gpus_per_node else max(1, min(size, gpus_per_node // stride))
        groups[axis] = AxisGroup(axis=axis, size=size, stride=stride, per_node=per_node)
        stride *= size
    groups["grad"] = _joint(groups["dp"], groups["cp"], gpus_per_node) \
        if "cp" in groups and groups["cp"].size > 1 else groups["dp"]
    return groups


def _joint(dp: AxisGroup, cp: AxisGroup, gpus_per_node: int) -> AxisGroup:
    """The group of dp·cp ranks (those differing only in their dp and cp coordinates),
    placed as the one holding rank 0."""
    inner, outer = sorted((dp, cp), key=lambda g: g.stride)
    ranks = [i * inner.stride + j * outer.stride for j in range(outer.size)
             for i in range(inner.size)]
    per_node = sum(1 for r in ranks if r < gpus_per_node)
    return AxisGroup(axis="grad", size=dp.size * cp.size, stride=inner.stride,
                     per_node=max(1, per_node))
