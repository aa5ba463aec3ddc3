"""fp8 copies in the profile: the float8 copies and scales a float8 linear keeps for
backward."""

from __future__ import annotations

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
