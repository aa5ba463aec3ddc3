"""The overlap plan of one stage graph: its communication buckets and overlap decisions,
which the comm_overlap pass makes (`ptc.passes.overlap_collectives`) and the runtime follows as
is; how bucket sizes are chosen and priced is `ptc.compiler.cost.buckets`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ptc.plan import Plan

if TYPE_CHECKING:
    from ptc.compiler.records.params import ParamLayout


IN_FLIGHT = 2
"""Gradient reductions left running behind backward with overlap on. Each holds its
bucket's full-size gradient, so this bounds that memory while one reduction still
overlaps the next layer's backward."""

GRAD_BYTES = 4
"""Bytes per element of the gradients reductions move (fp32 buffers)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OverlapPlan:
    """How one lowered graph's collectives overlap compute; the runtime follows it as is."""

    overlap: bool
    """Whether communication overlaps compute at all (`parallel.overlap`)."""
    bucket_bytes: int
    """Bucket size in bytes of fp32 gradient, resolved from `parallel.bucket_size`."""
    buckets: tuple[tuple[int, ...], ...]
    """Unit indices per bucket, in forward order. At ZeRO 0-2 the runtime reduces each
    bucket's gradients with one collective; at ZeRO-3 each bucket is one gather node."""
    bucket_bytes_each: tuple[int, ...]
    """fp32 gradient bytes of each bucket."""
    prefetch: int
    """ZeRO-3 gathers issued ahead of the one being waited on, in forward and backward."""
    in_flight: int
    """Gradient reductions left running while backward continues (0: wait for each)."""
    tp_fused: int = 0
    """Column-parallel linears whose input-gradient reduction overlaps their weight gradients."""


def default_overlap(layout: ParamLayout, plan: Plan) -> OverlapPlan:
    """The OverlapPlan of a stage graph the comm_overlap pass did not see: one bucket per
    unit of `layout` (the stage's parameter layout) and the plan's overlap switch."""
    on = plan.parallel.overlap
    sizes = tuple(GRAD_BYTES * u.padded_numel for u in layout.units)
    return OverlapPlan(overlap=on, bucket_bytes=max(sizes, default=0),
                       buckets=tuple((i,) for i in range(len(sizes))), bucket_bytes_each=sizes,
                       prefetch=int(on), in_flight=IN_FLIGHT if on else 0)
