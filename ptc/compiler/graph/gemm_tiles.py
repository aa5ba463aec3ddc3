"""How much of a GPU a matrix product of a given shape keeps busy: tile and wave quantisation.

A GPU's GEMM kernel cuts the output (m x n, for each of `batch` products) into
tiles and runs one tile at a time on each streaming multiprocessor (SM). Two
effects follow from the shape alone (NVIDIA, "Matrix Multiplication Background
User's Guide", Deep Learning Performance docs, "Tile quantization" and "Wave
quantization"):

- *tile quantisation*: a dimension that is not a multiple of the tile leaves
  the last row or column of tiles partly idle;
- *wave quantisation*: the tiles run in waves of one per SM (108 on A100, 132
  on H100); a last wave with fewer tiles than SMs leaves the rest idle.

The library picks the tile per shape (cuBLAS's heuristics: 256 x 128 for large
outputs, smaller tiles where those would waste a wave); the model takes, per
GEMM, the tile of `TILES` that wastes least. Its efficiency is the useful
share of the work the waves run:

    tiles = batch · ⌈m/tm⌉ · ⌈n/tn⌉,  waves = ⌈tiles / SMs⌉
    efficiency = batch · m · n / (waves · SMs · tm · tn)

and a GEMM takes its FLOPs / efficiency at the rate of a full wave. The
contraction dimension k sets each tile's time and wastes nothing. A product
that tensor parallelism splits is priced at the shape each rank runs
(`GemmShape.tp_dim`: the dimension the split divides).

Shapes come from the profile (`ptc.compiler.profile`): every GEMM of a
region, forward and backward, recorded on the meta device (`work.GemmCall`) at
several micro-batch sizes and sequence lengths, and each dimension fitted as
c · b^i · s^j (`fit_shapes`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ptc.compiler.graph.work import GemmCall

TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128))
"""Output tiles (rows x columns) a GEMM kernel may run: the CUTLASS/cuBLAS tile shapes
NVIDIA's guide names for Ampere and Hopper, both orientations."""

DIMS = ("batch", "m", "n", "k")
"""A GEMM's dimensions: `batch` products of (m x k) @ (k x n)."""

Monomial = tuple[float, int, int]
"""c · b^i · s^j as (c, i, j)."""


@dataclass(frozen=True, slots=True)
class GemmShape:
    """One GEMM of a region's phase, its dimensions as functions of (b, s)."""

    dims: tuple[Monomial, Monomial, Monomial, Monomial]
    """batch, m, n, k."""
    classes: frozenset[str]
    """The work classes of the graph node it is charged to ("tp", "kv", "whole"; see
    `ModelProfile.work`)."""
    tp_dim: str | None
    """The dimension tensor parallelism divides when the node is in class "tp" (None: the
    shape does not say; priced as k, which changes no tile)."""

    def at(self, bb: int, ss: int) -> list[float]:
        """The dimensions for a micro-batch of `bb` samples of `ss` positions."""
        return [c * bb**i * ss**j for c, i, j in self.dims]


def tile_efficiency(batch: float, m: float, n: float, multiprocessors: int) -> float:
    """The useful share of the waves a GEMM of `batch` (m x n) outputs runs, with the least
    wasteful tile of `TILES` (module docstring)."""
    best = 0.0
    for tm, tn in TILES:
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / multiprocessors)
        best = max(best, batch * m * n / (waves * multiprocessors * tm * tn))
    return best


def rank_shapes(shapes: Sequence[GemmShape], bb: int, ss: int, *, tp: int, kv_divisor: int,
                sp: bool) -> list[dict[str, int]]:
    """The dimensions (`DIMS`) of the GEMMs one rank runs for a micro-batch of `bb` samples
    of `ss` positions: a node of class "tp" ("kv") runs its GEMM with `tp_dim` divided by
    tp (`kv_divisor`); under sequence parallelism one outside "tp" and "whole" runs 1/tp of
    the sequence (its first dimension that grows with s). One of class "tp" whose
    `tp_dim` is unknown is returned whole: its tiles are those of a split k."""
    out = []
    for shape in shapes:
        dims = dict(zip(DIMS, (round(v) for v in shape.at(bb, ss))))
        divided, by = None, 1
        if "tp" in shape.classes:
            divided, by = shape.tp_dim, kv_divisor if "kv" in shape.classes else tp
        elif sp and "whole" not in shape.classes:
            divided = next((d for d, (_, _, j) in zip(DIMS, shape.dims) if j), None)
            by = tp
        if divided is not None and by > 1:
            dims[divided] = math.ceil(dims[divided] / by)
        out.append(dims)
    return out


def efficiency(shapes: Sequence[GemmShape], bb: int, ss: int, *, tp: int, kv_divisor: int,
               sp: bool, multiprocessors: int) -> float:
    """FLOPs over FLOPs-as-run (each GEMM's FLOPs / `tile_efficiency`) of one rank's GEMMs
    of a region's phase (`rank_shapes`): what divides their time at a full wave's rate. 1
    with no shapes."""
    flops = run = 0.0
    for dims in rank_shapes(shapes, bb, ss, tp=tp, kv_divisor=kv_divisor, sp=sp):
        work = dims["batch"] * dims["m"] * dims["n"] * dims["k"]
        if not work:
            continue
        flops += work
        run += work / tile_efficiency(dims["batch"], dims["m"], dims["n"], multiprocessors)
    return flops / run if run else 1.0


def split_dim(call: GemmCall, weight: str | None, split_param_dim: int | None,
              weight_shape: Sequence[int] | None) -> str | None:
    """The dimension of `call` that tensor parallelism divides, for a GEMM charged to a node
    of class "tp": a linear's product with its weight (`weight`, split along its dimension
    `split_param_dim`) divides the dimension that weight dimension maps to (forward: n of a
    column-parallel linear, k of a row-parallel one; input gradient: k, n); its weight
    gradient (no operand is the weight) divides the output dimension as long as the split
    weight dimension; any other product in the block (an attention's, per head) its batch."""
    if weight is None:
        return "batch" if call.batch > 1 else None
    if weight in call.param:
        return next((g for g, p in call.param_dims if p == split_param_dim), None)
    if weight_shape is not None and split_param_dim is not None:
        size = weight_shape[split_param_dim]
        return next((d for d in ("m", "n") if getattr(call, d) == size), None)
    return None


def fit_shapes(samples: dict[tuple[int, int], list[tuple[GemmCall, frozenset[str], str | None]]],
               grid: Sequence[tuple[int, int]], *, with_batch: bool
               ) -> tuple[GemmShape, ...] | None:
    """The GEMMs of one region's phase as `GemmShape`s, from the calls recorded at each
    point of `grid` (same graph, same order): each dimension c · b^i · s^j with i in {0, 1}
    (0 when not `with_batch`: the grid holds one micro-batch size) and j in {0, 1, 2},
    solved from the first points and checked at every other. None when the calls differ
    between points or a dimension is no such monomial: that region's GEMMs are then priced
    by their FLOPs alone."""
    calls = [samples[pt] for pt in grid]
    if len({len(c) for c in calls}) != 1:
        return None
    shapes = []
    for recorded in zip(*calls):
        if len({(classes, tp_dim) for _, classes, tp_dim in recorded}) != 1:
            return None
        dims = []
        for dim in DIMS:
            values = [getattr(call, dim) for call, _, _ in recorded]
            monomial = _monomial(grid, values, with_batch)
            if monomial is None:
                return None
            dims.append(monomial)
        _, classes, tp_dim = recorded[0]
        shapes.append(GemmShape(dims=tuple(dims), classes=classes, tp_dim=tp_dim))
    return tuple(shapes)


def _monomial(grid: Sequence[tuple[int, int]], values: Sequence[int],
              with_batch: bool) -> Monomial | None:
    (b0, s0), v0 = grid[0], values[0]
    for i in ((0, 1) if with_batch else (0,)):
        for j in (0, 1, 2):
            c = v0 / (b0**i * s0**j)
            if all(abs(c * pb**i * ps**j - v) < 0.5 for (pb, ps), v in zip(grid, values)):
                return (c, i, j)
    return None
