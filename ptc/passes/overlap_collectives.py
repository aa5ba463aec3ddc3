"""The overlap_collectives pass: bucket small collectives and schedule starts early, waits late.

The last pass of the pipeline: it sees every collective earlier passes put in
the graph and decides when each is issued and waited for.

- ZeRO-3 (`gather_params_start` / `gather_params` pairs from the zero pass):
  consecutive gathers smaller than the bucket merge into one (one start, one
  wait, one collective for all their units); each start then moves up to
  just after the wait `prefetch` gathers before it, so layer i+1's weights
  travel while layer i computes. A wait stays right before the first use of
  its weights, as late as its users allow. In backward the runtime re-gathers
  one gather ahead and leaves `in_flight` gradient reduce-scatters running.
- ZeRO 0-2: gradient reductions happen in backward, outside the forward
  graph: the pass groups the units into buckets the runtime reduces with one
  collective each, started as soon as the bucket's last gradient is
  accumulated. At ZeRO 1-2 the optimizer step's weight all-gathers are left
  in flight: an `await_weights(stage, unit)` node before the first node that
  reads a unit's weights waits for that unit's alone (`ptc.ops.weight_gathers`),
  so each one travels while the next forward computes the units before it.
- Tensor parallel: the input-gradient all-reduce (or sequence-parallel
  reduce-scatter) of column-parallel linears runs while their weight
  gradients are computed; with `tp_comm = async` every sequence-parallel
  all-gather and reduce-scatter runs in ring steps beside the GEMMs it
  feeds (see `ptc.passes.tp_overlap`).

Every decision is a function of the plan and the graph, and merging or
moving never changes the order in which one axis's collectives are issued:
the pass checks that the sequence of units gathered over dp is the same
before and after, so all ranks of a group issue the same collectives in the
same order. The decisions land in the graph's record as an `OverlapPlan`;
the runtime follows it without re-planning.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence

from torch import fx

from ptc.compiler.records.decisions import Decisions
from ptc.compiler.graph.stage_graphs import stage_info
from ptc.compiler.graph.meta import copy_meta, get_info, update_graph_record
from ptc.compiler.records.overlap import GRAD_BYTES, IN_FLIGHT, OverlapPlan
from ptc.compiler.cost.buckets import plan_buckets, resolve_bucket_bytes
from ptc.compiler.records.params import ParamLayout
from ptc.compiler.graph.params import shard_unit, used_params
from ptc.errors import CompileError
from ptc.passes.tp_overlap import fuse_column_parallel_linears
from ptc.plan import Plan
from ptc.ops.collectives import gather_params, gather_params_start
from ptc.ops.weight_gathers import await_weights
from ptc.units import format_bytes

log = logging.getLogger("ptc.passes.overlap_collectives")


def overlap_collectives_pass(gm: fx.GraphModule, decisions: Decisions, *,
                             prefetch: int | None = None,
                             in_flight: int | None = None) -> fx.GraphModule:
    """Merge small collectives into buckets and move ZeRO-3 gather starts a layer early.

    Communication hidden under compute is free; exposed, it is the step time
    that data parallelism adds. Knobs: `prefetch` (gathers started ahead,
    default 1 with `parallel.overlap`, else 0) and `in_flight` (gradient
    reductions left running behind backward, default IN_FLIGHT, 0 without
    overlap). Records an OverlapPlan in the graph's record. Runs on a stage
    graph, whose parameter layout the pipeline split fixed.
    """
    plan = decisions.plan
    on = plan.parallel.overlap
    prefetch = int(prefetch if prefetch is not None else 1 if on else 0)
    in_flight = int(in_flight if in_flight is not None else IN_FLIGHT if on else 0)
    zero3 = plan.parallel.zero == 3
    layout = decisions.stage_layout(stage_info(gm).index)
    if zero3:
        buckets, size, merged = _bucket_gathers(gm, plan, layout)
        moved = _prefetch(_gathers(gm), prefetch)
        changed = merged or moved
    else:
        sizes = [GRAD_BYTES * u.padded_numel for u in layout.units]
        size = resolve_bucket_bytes(plan, sizes)
        buckets = [tuple(b) for b in plan_buckets(sizes, size)]
        changed = on and plan.parallel.zero in (1, 2) and _await_weights(gm, layout)
    fused = _fuse_tp(gm, plan) if on else 0  # lints and recompiles the graphs it fuses in
    if changed:
        gm.graph.lint()
        gm.recompile()
    each = tuple(sum(GRAD_BYTES * layout.units[u].padded_numel for u in b) for b in buckets)
    update_graph_record(gm, overlap=OverlapPlan(
        overlap=on, bucket_bytes=size, buckets=tuple(buckets), bucket_bytes_each=each,
        prefetch=prefetch, in_flight=in_flight, tp_fused=fused))
    log.info("%d buckets of <= %s for %d units%s%s", len(buckets), format_bytes(size),
             sum(len(b) for b in buckets),
             f", gathers start {prefetch} ahead" if zero3 else "",
             _fused_text(fused, plan.parallel.tp_comm) if fused else "")
    return gm


def _fused_text(fused: int, tp_comm: str) -> str:
    """What the log says of the tp ops `_fuse_tp` fused."""
    if tp_comm == "async":
        return f", {fused} tp collectives run in ring steps beside their GEMMs"
    return f", {fused} tp input-gradient reductions overlap weight gradients"


# ------------------------------------------------------------------- ZeRO 1-2


def _await_weights(gm: fx.GraphModule, layout: ParamLayout) -> bool:
    """Put `await_weights(stage, unit)` before the first node that reads each unit's weights
    (a parameter's get_attr is a reference: its readers read); True when it put any."""
    unit_of = {alias: slot.unit for slot in layout.params.values() for alias in slot.aliases}
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    first: dict[int, fx.Node] = {}
    for node in gm.graph.nodes:
        for name, _ in used_params(gm, node):
            if name not in unit_of:
                raise CompileError(f"comm_overlap: {node.name} reads {name}, which no unit of "
                                   "the stage's layout holds")
            readers = [node] if node.op == "call_module" else list(node.users)
            if not readers:
                continue
            reader = min(readers, key=order.__getitem__)
            unit = unit_of[name]
            if unit not in first or order[reader] < order[first[unit]]:
                first[unit] = reader
    stage = stage_info(gm).index
    for unit, reader in sorted(first.items()):
        with gm.graph.inserting_before(reader):
            wait = gm.graph.call_function(await_weights, (stage, unit))
        copy_meta(reader, wait, kind="other", shapes=(), dtypes=(), flops=0, params=0,
                  param_bytes=0)
    return bool(first)


# ------------------------------------------------------------------- ZeRO-3


def _gathers(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """(start, wait) of every ZeRO-3 gather, in graph order."""
    out = []
    for node in gm.graph.nodes:
        if node.target is gather_params_start:
            waits = [u for u in node.users if u.target is gather_params]
            if len(waits) != 1:
                raise CompileError(f"comm_overlap: gather {node.name} has {len(waits)} waits, "
                                   f"expected 1")
            out.append((node, waits[0]))
    return out


def _units(start: fx.Node) -> list[int]:
    """Unit indices a gather start reads, from its shard inputs."""
    return [shard_unit(s) for s in start.args[0]]


def _dp_sequence(gm: fx.GraphModule) -> list[int]:
    """Units in the order their gathers are issued over dp: must never change."""
    return [u for start, _ in _gathers(gm) for u in _units(start)]


def _bucket_gathers(gm: fx.GraphModule, plan: Plan, layout: ParamLayout
                    ) -> tuple[list[tuple[int, ...]], int, bool]:
    """Merge runs of small consecutive gathers into one; return buckets, size, whether merged."""
    gathers = _gathers(gm)
    units = [_units(start) for start, _ in gathers]
    before = [u for us in units for u in us]
    sizes = [sum(GRAD_BYTES * layout.units[u].padded_numel for u in us) for us in units]
    size = resolve_bucket_bytes(plan, sizes)
    axes = [start.kwargs.get("axis", "dp") for start, _ in gathers]
    groups = [run for group in plan_buckets(sizes, size, units) for run in _same_axis(group, axes)]
    for group in groups:
        if len(group) > 1:
            _merge(gm.graph, [gathers[i] for i in group])
    if _dp_sequence(gm) != before:
        raise CompileError("comm_overlap: bucketing would reorder the dp gathers")
    buckets = [tuple(u for i in group for u in units[i]) for group in groups]
    return buckets, size, any(len(g) > 1 for g in groups)


def _same_axis(group: Sequence[int], axes: Sequence[str]) -> list[list[int]]:
    """`group` cut into runs of gathers over one axis: an expert unit's gather ("edp") and
    a dp one are different collectives, never merged."""
    runs: list[list[int]] = []
    for i in group:
        if runs and axes[runs[-1][-1]] == axes[i]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _merge(graph: fx.Graph, gathers: list[tuple[fx.Node, fx.Node]]) -> None:
    """Replace consecutive gathers by one start/wait pair at the first one's place."""
    (first_start, first_wait), rest = gathers[0], gathers[1:]
    shards = tuple(s for start, _ in gathers for s in start.args[0])
    for start, _ in rest:
        for shard in start.args[0]:
            first_start.prepend(shard)  # get_attr: valid anywhere before its users
    with graph.inserting_before(first_start):
        start = graph.call_function(gather_params_start, (shards,), dict(first_start.kwargs))
    with graph.inserting_before(first_wait):
        wait = graph.call_function(gather_params, (start, shards))
    copy_meta(first_start, start)
    waits = [get_info(w) for _, w in gathers]
    copy_meta(first_wait, wait, shapes=tuple(s for i in waits for s in i.shapes),
              dtypes=tuple(d for i in waits for d in i.dtypes))
    offset = 0
    for old_start, old_wait in gathers:
        for user in list(old_wait.users):
            if user.target is not operator.getitem:
                raise CompileError(f"comm_overlap: unexpected use {user.name} of {old_wait.name}")
            user.args = (wait, offset + user.args[1])
        offset += len(old_start.args[0])
        graph.erase_node(old_wait)
        graph.erase_node(old_start)


def _prefetch(gathers: list[tuple[fx.Node, fx.Node]], depth: int) -> bool:
    """Move each start (and its shard reads) right after the wait `depth` gathers before it."""
    if depth < 1:
        return False
    for index in range(depth, len(gathers)):
        anchor = gathers[index - depth][1]
        start = gathers[index][0]
        for node in (*start.args[0], start):
            anchor.append(node)
            anchor = node
    return len(gathers) > depth


# --------------------------------------------------------------- tensor parallel


def _fuse_tp(gm: fx.GraphModule, plan: Plan) -> int:
    """Fuse tp entry collectives with their column-parallel linears (tp > 1 only); with
    `tp_comm = async`, as collective matmuls, the row-parallel exits too."""
    if plan.parallel.tp == 1:
        return 0
    return fuse_column_parallel_linears(gm, collective_matmul=plan.parallel.tp_comm == "async")
