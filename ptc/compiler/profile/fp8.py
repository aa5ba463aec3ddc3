"""What float8 GEMMs add to a profile: the float8 copies and scales one keeps for
backward, and the casts it runs beside its GEMMs, per `train.fp8_recipe`
(`ptc.ops.fp8_linear`; the routed experts' grouped products, `ptc.ops.fp8_grouped`).

Terms: a GEMM's *copy* is the float8 copy of its input it keeps for the
weight gradient (one byte an element of the bf16 storage); its *scales* are
what it keeps beside it: tensorwise the input's and the weights' fp32 scales
(FP8_SCALE_BYTES for a linear; a grouped product one per expert more than
its one input scale), rowwise one fp32 per column of the input (its in
features; a grouped product's per expert's group), mxfp8 one E8M0 byte per 32
elements of the copy. A grouped product's counts are the whole stack's: an ep
rank keeps its own experts' (fewer, by a few bytes an expert), and mxfp8's
blocks along an expert's rows end with the group, so a run keeps up to one
byte more per expert and column than a whole number of blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import sympy
import torch.fx

from ptc.compiler.graph.nodes import is_fp8_grouped, is_fp8_linear, linear_in_dim, \
    linear_weight
from ptc.compiler.graph.work import GemmCall
from ptc.compiler.profile.types import FP8_SCALE_BYTES, MX_SCALE_ELEMENTS, ROWWISE_SCALE_BYTES


@dataclass(frozen=True)
class Fp8Gemms:
    """The float8 GEMMs of a captured graph under one recipe: node name -> in features, and
    of its grouped products node name -> experts."""

    recipe: str
    in_features: Mapping[str, int]
    experts: Mapping[str, int] = field(default_factory=dict)

    def __contains__(self, name: object) -> bool:
        return name in self.in_features

    def scale_bytes(self, name: str, elements: int) -> int | sympy.Rational:
        """Bytes of the scales GEMM `name` keeps beside a copy of `elements` elements
        (mxfp8: a fraction where the profile's sample shapes hold no whole blocks, so the
        fitted polynomial is exact)."""
        experts = self.experts.get(name, 1)
        if self.recipe == "rowwise":
            return ROWWISE_SCALE_BYTES * self.in_features[name] * experts
        if self.recipe == "mxfp8":
            return sympy.Rational(elements, MX_SCALE_ELEMENTS)
        if name in self.experts:  # the input's scale, and one per expert's weight
            return FP8_SCALE_BYTES // 2 * (1 + experts)
        return FP8_SCALE_BYTES

    def split_scale_bytes(self, name: str) -> int:
        """Of `scale_bytes`, the batch-free bytes that tp splits as it splits the GEMM's
        input features: rowwise's column scales (a row-parallel GEMM keeps its shard's)."""
        return self.scale_bytes(name, 0) if self.recipe == "rowwise" else 0


NO_FP8 = Fp8Gemms("tensorwise", {})
"""No float8 GEMMs (a plan not in fp8)."""


def fp8_gemms(gm: torch.fx.GraphModule, recipe: str | None) -> Fp8Gemms:
    """The float8 GEMMs of `gm` (`is_fp8_linear`, `is_fp8_grouped`) when profiled for
    `recipe` (None: not fp8), each with its weight's input features (and a grouped
    product's experts)."""
    if recipe is None:
        return NO_FP8
    gemms = [n for n in gm.graph.nodes if is_fp8_linear(n) or is_fp8_grouped(n)]
    return Fp8Gemms(recipe, {n.name: _weight_shape(gm, n)[linear_in_dim(n)] for n in gemms},
                      {n.name: _weight_shape(gm, n)[0] for n in gemms if is_fp8_grouped(n)})


def _weight_shape(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[int, ...]:
    return tuple(gm.get_parameter(linear_weight(node)).shape)


def with_fp8_copies(storage, fp8: Fp8Gemms, savers=None) -> int:
    """Bytes a saved storage costs when kept by `savers` (all its savers when None; a
    storage nothing saves is held as a checkpoint's input, whole), each float8 GEMM among
    them keeping its own float8 copy of it instead (`kept_as`)."""
    if savers is None and not storage.savers:
        return storage.nbytes
    whole, copies, _ = kept_as(storage, fp8, storage.savers if savers is None else savers)
    return storage.nbytes * whole + copies


def kept_as(storage, fp8: Fp8Gemms, savers) -> tuple[bool, int, int]:
    """(whether the storage itself is kept, bytes of float8 copies kept of it, of those the
    batch-free scale bytes tp splits) when `savers` keep it: each float8 GEMM
    (`ptc.ops.fp8_linear`) keeps its own copy of a floating-point storage, one byte an
    element of the bf16 storage, and its scales (an integer one, a grouped product's
    offsets, it keeps as it is); the storage itself stays when another saver keeps it or
    it is held (the next layer's input)."""
    users = [x for x in savers if x in fp8] if storage.floating else []
    whole = bool(savers) and (len(users) < len(savers) or storage.held)
    elements = storage.nbytes // 2
    copies = sum(elements + fp8.scale_bytes(x, elements) for x in users)
    return whole, copies, sum(fp8.split_scale_bytes(x) for x in users)


CAST_OPS = {"ops": 7, "kern": 2}
"""Ops one quantisation dispatches (`ptc.ops.fp8_linear`: abs, amax, the scale, divide,
clamp, cast...), and the kernels it takes fused (the amax, then the scaled cast)."""
TRANSPOSE_OPS = {"ops": 1, "kern": 1}
"""A float8 copy laid out transposed for the GEMM that reads it: one copy kernel."""
QUANTISED = {  # phase -> (operand, laid out transposed) per quantisation
    "fwd": (("x", False), ("x", True), ("weight", False)),
    "bwd": (("out", False), ("out", True), ("weight", True)),
}
"""What rowwise and mxfp8 quantise per phase: forward x along K (the forward GEMM) and
along M (the copy kept for wgrad, transposed: cuBLAS reads it column-major), the weight
along K; backward the output gradient along N (dgrad) and along M (wgrad, transposed),
the weight along N (dgrad, transposed)."""


def fp8_casts(gemm: GemmCall, phase: str, recipe: str = "tensorwise", experts: int = 1
              ) -> dict[str, float]:
    """The memory-bound work a float8 GEMM adds to its GEMMs in `phase`, from the shape of
    its forward GEMM (x [m, k] times the weight [n, k]; a grouped product's m rows times
    `experts` such weights, each quantised), as `recipe` quantises.

    tensorwise: quantising a bf16 tensor of E elements reads it twice (its
    amax, then the cast) and writes E float8 bytes: 5E bytes; with a known
    scale, 3E. Forward quantises x and the weight; backward the output
    gradient [m, n] and the weight again with the forward's scale (x's float8
    copy is kept). Fused (`runtime.compile`), the amax of x and of the output
    gradient is taken in the kernel that makes them, which reads them anyway:
    3E each; the weight's casts are kernels of their own either way.

    rowwise and mxfp8 (`QUANTISED`): each operand once per GEMM it feeds, each
    quantisation 5E (its amaxes, then the cast; the scales are per row or block
    of the operand's own values, taken right before the cast, so no kernel
    before fuses them and fused equals unfused), plus 2E for a copy written
    transposed (read and written once more, float8); mxfp8 also writes one
    E8M0 byte per 32 elements.
    """
    if recipe == "tensorwise":
        return _tensorwise_casts(gemm, phase, experts)
    sizes = {"x": gemm.m * gemm.k, "weight": experts * gemm.n * gemm.k, "out": gemm.m * gemm.n}
    moved, ops, kern = 0.0, 0, 0
    for operand, transposed in QUANTISED[phase]:
        elements = sizes[operand]
        moved += 5 * elements + 2 * elements * transposed
        moved += elements / MX_SCALE_ELEMENTS if recipe == "mxfp8" else 0
        ops += CAST_OPS["ops"] + TRANSPOSE_OPS["ops"] * transposed
        kern += CAST_OPS["kern"] + TRANSPOSE_OPS["kern"] * transposed
    return {"mem": moved, "fmem": moved, "ops": ops, "kern": kern}


def _tensorwise_casts(gemm: GemmCall, phase: str, experts: int) -> dict[str, float]:
    """`fp8_casts` of the tensorwise recipe (its docstring)."""
    x, weight, out = gemm.m * gemm.k, experts * gemm.n * gemm.k, gemm.m * gemm.n
    if phase == "fwd":
        moved, fused = 5 * x + 5 * weight, 3 * x + 5 * weight
    else:
        moved, fused = 5 * out + 3 * weight, 3 * out + 3 * weight
    return {"mem": moved, "fmem": fused, "ops": 2 * CAST_OPS["ops"],
            "kern": 2 * CAST_OPS["kern"]}
