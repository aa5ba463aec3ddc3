"""Fit the links' latency and bandwidth to measured collectives, through the cost model itself.

Each measurement is one collective (all-reduce, all-gather, reduce-scatter,
send/recv) of S bytes on one mesh axis's group, and the time it took. The
cost model (`ptc.compiler.cost.collectives`) prices it with the links the group uses
(intra inside a node, inter across, both for a group spanning nodes) and the
algorithm it would choose; for a fixed choice that time is linear in each
link's latency alpha and inverse bandwidth 1/B. The fit finds the alpha and
1/B that minimise the squared *relative* error over all measurements (small
messages, where latency decides, weigh as much as large ones), re-deciding
the algorithms from the fitted figures until they settle. A link no
measurement uses keeps the hardware's figure.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

import numpy as np

from ptc.compiler.cost import collectives as comm
from ptc.compiler.cost.topology import AxisGroup
from ptc.plan import HardwareSpec, LinkSpec

LINKS = ("intra", "inter")
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


@dataclass(frozen=True, slots=True)
class Measurement:
    """One collective as timed."""

    op: str
    """One of `OPS`."""
    size: float
    """Bytes: the all-reduce buffer, all-gather output, reduce-scatter input, or bytes sent."""
    group: AxisGroup
    """Where the axis's ranks sit (`ptc.compiler.cost.topology`)."""
    seconds: float
    """Measured time of one collective."""


@dataclass(frozen=True, slots=True)
class LinkFit:
    """Fitted figures and how well the cost model then reproduces the measurements."""

    links: dict[str, LinkSpec]
    """Fitted links, only those some measurement used."""
    median_error: float
    """Median |predicted / measured - 1| over the measurements, with the fitted links."""
    max_error: float
    """Largest |predicted / measured - 1|."""


def predict(m: Measurement, hw: HardwareSpec) -> float:
    """The cost model's seconds for measurement `m` on `hw`."""
    return getattr(comm, m.op)(m.size, m.group, hw).seconds


def _with(hw: HardwareSpec, params: dict[str, list[float]]) -> HardwareSpec:
    return dataclasses.replace(hw, **{name: LinkSpec(bandwidth=1.0 / inv, latency=lat)
                                      for name, (lat, inv) in params.items()})


def fit_links(measurements: list[Measurement], hw: HardwareSpec, *,
              rounds: int = 30) -> LinkFit:
    """The latency and bandwidth of each link that make `comm` reproduce `measurements`
    best (relative least squares; see the module docstring), starting from `hw`'s."""
    if not measurements:
        return LinkFit(links={}, median_error=0.0, max_error=0.0)
    params = {name: [getattr(hw, name).latency, 1.0 / getattr(hw, name).bandwidth]
              for name in LINKS}
    columns = [(name, k) for name in LINKS for k in (0, 1)]
    used: list[tuple[str, int]] = []
    for _ in range(rounds):
        base_hw = _with(hw, params)
        rows, rhs = [], []
        coefficients = []
        for m in measurements:
            base = predict(m, base_hw)
            coeffs = []
            for name, k in columns:
                step = max(abs(params[name][k]), 1e-12) * 1e-3
                moved = {n: list(v) for n, v in params.items()}
                moved[name][k] += step
                coeffs.append((predict(m, _with(hw, moved)) - base) / step)
            coefficients.append(coeffs)
            const = base - sum(c * params[n][k] for c, (n, k) in zip(coeffs, columns))
            rows.append([c / m.seconds for c in coeffs])
            rhs.append(1.0 - const / m.seconds)
        a = np.array(rows)
        used = [col for j, col in enumerate(columns) if np.any(np.abs(a[:, j]) > 0)]
        keep = [j for j, col in enumerate(columns) if col in used]
        solution, *_ = np.linalg.lstsq(a[:, keep], np.array(rhs), rcond=None)
        changed = 0.0
        for value, j in zip(solution, keep):
            name, k = columns[j]
            floor = 0.0 if k == 0 else 1e-15  # a latency may be 0; a bandwidth stays finite
            new = max(float(value), floor)
            old = params[name][k]
            changed = max(changed, abs(new - old) / max(abs(old), 1e-15))
            params[name][k] = new
        if changed < 1e-9:
            break
    fitted = _with(hw, params)
    errors = [abs(predict(m, fitted) / m.seconds - 1) for m in measurements]
    links = {name: getattr(fitted, name) for name in LINKS if any(n == name for n, _ in used)}
    return LinkFit(links=links, median_error=statistics.median(errors), max_error=max(errors))
