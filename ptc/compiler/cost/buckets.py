"""Communication buckets and overlap decisions: what the comm_overlap pass hands the runtime.

Terms. An *item* is one collective the runtime would otherwise issue on its
own: a ZeRO-3 `gather_params` of one layer (whose backward is that layer's
gradient reduce-scatter), or, at ZeRO 0-2, one unit's gradient all-reduce or
reduce-scatter (a *unit* is a flat parameter buffer, see
`ptc.compiler.records.program`). A *bucket* is a run of consecutive items issued as
one collective: each collective pays a fixed latency (alpha), so many small
ones waste the link, while one huge one cannot start until all its gradients
exist and so overlaps nothing.

Bucket size, "auto": large enough that latency is at most a tenth of the
transfer on the link the dp axis uses (bytes >= 9·alpha·bandwidth), and no
larger than the largest item (a transformer layer), so merging never delays
the first reduction of backward past one layer's gradient computation. Items
are sized by their fp32 gradient bytes (what the reduction moves). An item
at least as large as the bucket stays alone; smaller consecutive items join
until the next would overflow it. Everything here is a function of the plan
and the graph alone, so every rank computes the same buckets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ptc.compiler.cost.collectives import all_gather, all_reduce, reduce_scatter
from ptc.compiler.cost.topology import AxisGroup, axis_placements
from ptc.compiler.records.overlap import GRAD_BYTES
from ptc.plan import DTYPE_BYTES, LinkSpec, Plan

if TYPE_CHECKING:
    from ptc.compiler.profile.types import ModelProfile
    from ptc.compiler.records.layout import Layout


LATENCY_SHARE = 0.1
"""Largest share of a bucket's transfer time that link latency may take ("auto" size)."""


def dp_group(plan: Plan) -> AxisGroup:
    """Where a group of the (resolved) plan's gradient ranks (dp·cp) sits on the nodes."""
    par = plan.parallel
    degrees = {a: par.degree(a) for a in par.order}
    return axis_placements(degrees, par.order, plan.hardware.gpus_per_node)["grad"]


def dp_link(plan: Plan) -> LinkSpec:
    """The link the dp axis's collectives cross: NVLink inside a node, else the inter-node one."""
    return plan.hardware.inter if dp_group(plan).spans_nodes else plan.hardware.intra


def link_bucket_bytes(link: LinkSpec) -> int:
    """Smallest transfer whose latency is at most LATENCY_SHARE of its time on `link`."""
    return math.ceil(link.latency * link.bandwidth * (1 - LATENCY_SHARE) / LATENCY_SHARE)


def resolve_bucket_bytes(plan: Plan, item_bytes: Sequence[int]) -> int:
    """`parallel.bucket_size`, or for "auto" the link's size (`link_bucket_bytes`).

    At ZeRO-3 "auto" is also capped at the largest item: a merged gather holds
    the full weights of its whole bucket at once, so a bucket larger than the
    largest layer would raise peak memory. Gradient buckets (ZeRO 0-2) reduce
    tensors that are resident anyway: fewer, larger collectives pay fewer
    latencies (DDP's 25 MB buckets, for the same reason).
    """
    size = plan.parallel.bucket_size
    if size != "auto":
        return int(size)
    link = link_bucket_bytes(dp_link(plan))
    if plan.parallel.zero < 3:
        return link
    return max(1, min(link, max(item_bytes, default=1)))


def plan_buckets(item_bytes: Sequence[int], bucket_bytes: int,
                 item_units: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """Group consecutive items into buckets of at most `bucket_bytes` (an oversized item alone).

    `item_units`, when given, names the units each item touches: two items
    sharing a unit (a tied weight gathered twice) never share a bucket, since
    one collective cannot carry one shard twice.
    """
    buckets: list[list[int]] = []
    total = 0
    units: set[int] = set()
    for index, size in enumerate(item_bytes):
        mine = set(item_units[index]) if item_units is not None else set()
        fits = buckets and total + size <= bucket_bytes and not (units & mine)
        if not fits:
            buckets.append([])
            total, units = 0, set()
        buckets[-1].append(index)
        total += size
        units |= mine
    return buckets


@dataclass(frozen=True, slots=True, kw_only=True)
class PredictedBucket:
    """One bucket as `ptc explain` shows it, before any graph exists."""

    items: tuple[str, ...]
    """What it carries: "embedding", "layers.3", "head", ..."""
    grad_bytes: int
    """fp32 gradient bytes per rank (tp-local)."""
    seconds: float
    """Predicted time of its collectives per micro-batch (ZeRO-3: two gathers and a
    reduce-scatter; ZeRO-2: a reduce-scatter; ZeRO-1: a reduce-scatter, once per step;
    ZeRO-0: an all-reduce, once per step)."""


def predicted_buckets(plan: Plan, profile: ModelProfile, layout: Layout, stage: int
                      ) -> tuple[int, list[PredictedBucket]]:
    """The bucket size and the buckets the comm_overlap pass will make for pipeline `stage`.

    Items come from the model profile in forward order — the embedding on the
    first stage, one per layer, the final norm and head on the last — with
    the same sizes and rule as the pass; the compiled graph's units may split
    an item further (a learned position table is a unit of its own), which
    `ptc inspect` shows exactly.
    """
    pr, tp = profile.params, layout.tp
    # Expert parallelism: a rank reduces the gradients of its 1/ep of the experts only.
    experts = {region: (g.experts // tp + g.experts_whole) * (layout.ep - 1) // layout.ep
               for region, g in pr.items()}
    per_rank = {region: GRAD_BYTES * (g.split // tp + g.replicated - experts[region])
                for region, g in pr.items()}
    items: list[tuple[str, int, tuple]] = []  # (name, bytes, units it touches)
    if stage == 0:
        items.append(("embedding", per_rank["pre"], ("pre",)))
    items += [(f"layers.{i}", per_rank["layer"], (i,)) for i in layout.stage_layers(stage)]
    if stage == layout.last_rank:
        # ZeRO-3 re-gathers a tied embedding for the head; split into stages, the last
        # stage holds its own copy.
        regathers = profile.tied and plan.parallel.zero == 3 and layout.pp == 1
        copy = GRAD_BYTES * profile.tied_elements // tp if profile.tied and layout.pp > 1 else 0
        items.append(("norm + head", per_rank["post"] + copy,
                      ("post", "pre") if regathers else ("post",)))
    names, sizes, units = zip(*items)
    size = resolve_bucket_bytes(plan, sizes)
    group = dp_group(plan)
    out = []
    for members in plan_buckets(sizes, size, units):
        grad = sum(sizes[i] for i in members)
        out.append(PredictedBucket(items=tuple(names[i] for i in members), grad_bytes=grad,
                                   seconds=_bucket_seconds(plan, grad, group)))
    return size, out


def _bucket_seconds(plan: Plan, grad_bytes: int, group: AxisGroup) -> float:
    """Predicted seconds of one bucket's collectives per micro-batch (see PredictedBucket)."""
    hw, zero = plan.hardware, plan.parallel.zero
    if zero == 3:
        weights = grad_bytes // GRAD_BYTES * DTYPE_BYTES[plan.train.compute_dtype]
        return 2 * all_gather(weights, group, hw).seconds + \
            reduce_scatter(grad_bytes, group, hw).seconds
    moved = grad_bytes // GRAD_BYTES * plan.grad_wire_bytes  # as the reduction moves them
    if zero in (1, 2):
        return reduce_scatter(moved, group, hw).seconds
    return all_reduce(moved, group, hw).seconds
