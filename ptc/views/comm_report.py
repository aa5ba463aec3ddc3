"""`ptc bench-comm`'s report: one table per mesh axis of the measured collectives against
what the cost model expects (`ptc.runtime.bench_comm`), then the axes flagged below it."""

from __future__ import annotations

from rich.console import Group

from ptc.runtime.bench_comm import FLAG_BELOW, CommReport
from ptc.units import format_bytes, format_seconds
from ptc.views.tables import FitTable


def render_comm(report: CommReport) -> Group:
    """One table per axis (nccl-tests' columns plus the expectation), then the flags."""
    tables = []
    for axis in dict.fromkeys(r.axis for r in report.results):
        rows = [r for r in report.results if r.axis == axis]
        table = FitTable(title=f"axis {axis}: {rows[0].ranks} ranks on {report.device}")
        for name in ("op", "size", "time", "algbw GB/s", "busbw GB/s", "expected busbw",
                     "of expected", "model algorithm"):
            table.add_column(name, justify="left" if name in ("op", "model algorithm")
                             else "right")
        for r in rows:
            table.add_row(r.op, format_bytes(r.size), format_seconds(r.seconds),
                          f"{r.algbw / 1e9:.2f}", f"{r.busbw / 1e9:.2f}",
                          f"{r.expected_busbw / 1e9:.2f}", f"{r.efficiency:.0%}", r.algorithm)
        tables.append(table)
    lines = [f"FLAG axis {r.axis}: {r.op} at {format_bytes(r.size)} reaches {r.efficiency:.0%} "
             f"of the expected {r.expected_busbw / 1e9:.2f} GB/s bus bandwidth "
             f"(below {FLAG_BELOW:.0%})" for r in report.flagged]
    if not report.results:
        lines.append("no mesh axis has more than one rank: nothing to measure")
    elif not lines:
        lines.append(f"every axis reaches at least {FLAG_BELOW:.0%} of its expected bandwidth")
    return Group(*tables, *lines)
