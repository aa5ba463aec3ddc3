"""Units of quantities in plans, and their conversion to SI base values.

Every quantity inside ptc is a plain float in a base unit: bytes, bytes per
second, FLOP per second, seconds, watts. Plan files write quantities with a unit
(`80 GiB`, `450 GB/s`, `400 Gb/s`, `989 TFLOP/s`, `2 us`, `30 min`, `500 W`); this
module says which units exist, what they are worth and which dimension each
measures, so the DSL can reject `tp = 4 GB` or `hbm = 3 ms`.
"""

from __future__ import annotations

_DECIMAL = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}


def _build_units() -> dict[str, tuple[str, float]]:
    units: dict[str, tuple[str, float]] = {}
    for prefix, scale in _DECIMAL.items():
        units[f"{prefix}B"] = ("bytes", scale)
        units[f"{prefix}B/s"] = ("bandwidth", scale)
        units[f"{prefix}b/s"] = ("bandwidth", scale / 8)
        units[f"{prefix}FLOP/s"] = ("flops", scale)
    for prefix, scale in _BINARY.items():
        units[f"{prefix}B"] = ("bytes", scale)
        units[f"{prefix}B/s"] = ("bandwidth", scale)
    units.update({
        "ns": ("time", 1e-9), "us": ("time", 1e-6), "ms": ("time", 1e-3),
        "s": ("time", 1.0), "min": ("time", 60.0), "h": ("time", 3600.0),
        "W": ("power", 1.0), "kW": ("power", 1e3),
    })
    return units


UNITS: dict[str, tuple[str, float]] = _build_units()
"""Unit symbol -> (dimension, value of one unit in the base unit of that dimension)."""

DIMENSION_EXAMPLES = {
    "bytes": "80 GiB, 40 GB",
    "bandwidth": "450 GB/s, 400 Gb/s",
    "flops": "989 TFLOP/s",
    "time": "5 us, 2 ms, 30 min",
    "power": "500 W, 1.2 kW",
}
"""One example per dimension, for error messages."""


def units_of(dimension: str) -> list[str]:
    """The unit symbols that measure `dimension`, smallest first."""
    return [u for u, (dim, _) in sorted(UNITS.items(), key=lambda kv: kv[1][1]) if dim == dimension]


def format_bytes(n: float) -> str:
    """Human-readable binary size, e.g. `140.0 GiB`."""
    for unit, scale in (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def format_seconds(t: float) -> str:
    """Human-readable duration, e.g. `12.3 ms`."""
    if t >= 1.0:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    return f"{t * 1e6:.1f} us"


def format_duration(t: float) -> str:
    """Human-readable duration that may be long, e.g. `12.3 ms`, `42 min`, `5.7 h`."""
    if t < 60:
        return format_seconds(t)
    if t < 3600:
        return f"{t / 60:.0f} min"
    if t < 2 * 86400:
        return f"{t / 3600:.1f} h"
    return f"{t / 86400:.0f} days"
