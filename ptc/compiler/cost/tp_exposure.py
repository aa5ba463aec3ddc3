"""How much of one layer's tensor-parallel communication ptc's runtime leaves exposed.

A collective is hidden only behind the compute that runs beside it in the
runtime that executes the plan, and the lowered graph fixes which that is
(`ptc.passes.tp_overlap`). Per layer and micro-batch, with E entries (inputs
of column-parallel linears) and X exits (row-parallel linears), each moving
one b·s·h boundary, and T_col, T_row the forward GEMM time of the layer's
column- and row-parallel linears on a rank (their input and weight
gradients take as long again each):

| collective                                   | sync (`tp_comm = sync`)      | async (collective matmul)        |
|----------------------------------------------|------------------------------|----------------------------------|
| forward: E all-gathers (SP) / identities     | exposed                      | behind f·T_col                   |
| forward: X reduce-scatters (SP) / all-reduces| exposed                      | behind f·T_row                   |
| backward: re-gathers of entry inputs (SP)    | behind the input gradient, T_col | behind f·T_col                |
| backward: E reduce-scatters (SP) / all-reduces| behind the weight gradient, T_col | behind f·T_col               |
| backward: X all-gathers of the exit gradient | exposed                      | behind f·2·T_row                 |

f = (tp - 1)/tp: a ring of tp steps has one chunk's GEMM with nothing left
to travel beside it. The re-gathers are one per entry whose input no
recompute region rebuilds (`ptc.compiler.cost.step.regathers`). A layer's
recompute under RERUN_LAYER runs its forward's collectives again, as its
forward does; what recompute regions gather again (`rerun_gathers`) and what
sequence parallelism runs whole are exposed.
Without `parallel.overlap`, or on a CPU (whose cores run the collectives and
the compute both), everything is exposed. Each row is a sum over its
collectives, hidden as a whole: max(0, collectives - compute beside them).
"""

from __future__ import annotations

from dataclasses import dataclass

from ptc.compiler.cost.compute import Rates, Split
from ptc.compiler.graph.gemm_tiles import rank_shapes
from ptc.compiler.profile.types import ModelProfile


@dataclass(frozen=True, slots=True)
class BoundaryCollectives:
    """Seconds of one collective of one layer boundary (b·s·h elements) over tp."""

    all_gather: float
    reduce_scatter: float
    all_reduce: float


@dataclass(frozen=True, slots=True)
class LinearTimes:
    """Forward GEMM seconds of one layer's column- and row-parallel linears on a rank."""

    column: float
    row: float


@dataclass(frozen=True, slots=True)
class TPTime:
    """One layer's tensor-parallel communication in one micro-batch: issued and exposed."""

    issued: float
    exposed: float

    @property
    def hidden(self) -> float:
        """Seconds that ran beside compute."""
        return self.issued - self.exposed


def linear_times(profile: ModelProfile, r: Rates, *, bb: int, ss: int, split: Split,
                 weight_grad: float) -> LinearTimes:
    """The forward GEMM time of a layer's column-parallel (the split weight dimension is the
    output, n) and row-parallel (k) linears per rank, from the profile's GEMM shapes at the
    plan's rate; without shapes, `weight_grad` (the layer's linears' forward GEMMs: a
    split backward's W) shared between entries and exits by their count."""
    shapes = (profile.gemms_b1 if bb == 1 else profile.gemms).get("layer.fwd", ())
    flops = {"n": 0.0, "k": 0.0}
    for shape, dims in zip(shapes, rank_shapes(shapes, bb, ss, tp=split.tp,
                                               kv_divisor=split.kv_divisor, sp=split.sp)):
        if "tp" in shape.classes and dims["batch"] == 1 and shape.tp_dim in flops:
            flops[shape.tp_dim] += 2.0 * dims["m"] * dims["n"] * dims["k"]
    if flops["n"] and flops["k"]:
        return LinearTimes(column=flops["n"] / r.gemm, row=flops["k"] / r.gemm)
    entries, exits = profile.tp_entries, profile.tp_exits
    share = entries / (entries + exits) if entries + exits else 0.5
    return LinearTimes(column=weight_grad * share, row=weight_grad * (1 - share))


def layer_tp_time(profile: ModelProfile, *, tp: int, sp: bool, async_tp: bool, overlap: bool,
                  rerun_layer: bool, regathers: int, each: BoundaryCollectives,
                  linears: LinearTimes, exposed_extra: float) -> TPTime:
    """One layer's tp communication (module docstring's table): `rerun_layer` when its
    recompute reruns the whole forward; `regathers` the entry inputs backward gathers
    again; `exposed_extra` the seconds that are never hidden (recompute regions' gathers,
    what sequence parallelism runs whole)."""
    if tp == 1:
        return TPTime(0.0, 0.0)
    entries, exits = profile.tp_entries, profile.tp_exits
    ring = (tp - 1) / tp if async_tp else 0.0
    forwards = 2 if rerun_layer else 1
    if sp:
        rows = [(forwards * entries * each.all_gather, forwards * ring * linears.column),
                (forwards * exits * each.reduce_scatter, forwards * ring * linears.row),
                (regathers * each.all_gather, linears.column * (ring or 1.0)),
                (entries * each.reduce_scatter, linears.column * (ring or 1.0)),
                (exits * each.all_gather, 2 * ring * linears.row)]
    else:
        rows = [(forwards * exits * each.all_reduce, 0.0),
                (entries * each.all_reduce, linears.column)]
    issued = sum(seconds for seconds, _ in rows) + exposed_extra
    if not overlap:
        return TPTime(issued, issued)
    exposed = sum(max(0.0, seconds - beside) for seconds, beside in rows) + exposed_extra
    return TPTime(issued, exposed)
