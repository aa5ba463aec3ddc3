"""What float8 linears add to a profile: the float8 copies and scales one keeps for
backward, and the casts it runs beside its GEMMs."""

from __future__ import annotations

from ptc.compiler.graph.work import GemmCall
from ptc.compiler.profile.types import FP8_SCALE_BYTES


def with_fp8_copies(storage, fp8_linears: set[str], savers=None) -> int:
    """Bytes a saved storage costs when kept by `savers` (all its savers when None; a
    storage nothing saves is held as a checkpoint's input, whole), each float8 GEMM among
    them keeping its own float8 copy of it instead (`kept_as`)."""
    if savers is None and not storage.savers:
        return storage.nbytes
    whole, copies = kept_as(storage, fp8_linears, storage.savers if savers is None else savers)
    return storage.nbytes * whole + copies


def kept_as(storage, fp8_linears: set[str], savers) -> tuple[bool, int]:
    """(whether the storage itself is kept, bytes of float8 copies kept of it) when
    `savers` keep it: each float8 GEMM (`ptc.ops.fp8_linear`) keeps its own copy, one
    byte an element of the bf16 storage, and its scales; the storage itself stays when
    another saver keeps it or it is held (the next layer's input)."""
    users = [x for x in savers if x in fp8_linears]
    whole = bool(savers) and (len(users) < len(savers) or storage.held)
    return whole, len(users) * (storage.nbytes // 2 + FP8_SCALE_BYTES)


CAST_OPS = {"ops": 7, "kern": 2}
"""Ops one quantisation dispatches (`ptc.ops.fp8_linear`: abs, amax, the scale, divide,
clamp, cast...), and the kernels it takes fused (the amax, then the scaled cast)."""


def fp8_casts(gemm: GemmCall, phase: str) -> dict[str, float]:
    """The memory-bound work a float8 linear adds to its GEMMs in `phase`, from the shape of
    its forward GEMM (x [m, k] times the weight [n, k]).

    Quantising a bf16 tensor of E elements reads it twice (its amax, then the
    cast) and writes E float8 bytes: 5E bytes; with a known scale, 3E.
    Forward quantises x and the weight; backward the output gradient [m, n]
    and the weight again with the forward's scale (x's float8 copy is kept).
    Fused (`runtime.compile`), the amax of x and of the output gradient is
    taken in the kernel that makes them, which reads them anyway: 3E each; the
    weight's casts are kernels of their own either way.
    """
    x, weight, out = gemm.m * gemm.k, gemm.n * gemm.k, gemm.m * gemm.n
    if phase == "fwd":
        moved, fused = 5 * x + 5 * weight, 3 * x + 5 * weight
    else:
        moved, fused = 5 * out + 3 * weight, 3 * out + 3 * weight
    return {"mem": moved, "fmem": fused, "ops": 2 * CAST_OPS["ops"],
            "kern": 2 * CAST_OPS["kern"]}
