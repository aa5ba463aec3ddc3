"""`bench_comm`: every operation and size on every mesh axis, nccl-tests' bandwidths, flags."""

from __future__ import annotations

import pytest
from ckpt_helpers import ckpt_plan
from rich.console import Console

from ptc.runtime.bench_comm import (
    OPS,
    CommReport,
    CommResult,
    bench_comm,
    parse_size,
    sizes_between,
)
from ptc.views.comm_report import render_comm


def result(op: str, size: int, seconds: float, expected: float, ranks: int = 4) -> CommResult:
    return CommResult("dp", op, ranks, size, seconds, expected, "ring")


@pytest.mark.timeout(10)
def test_sizes_and_bus_bandwidth_follow_nccl_tests():
    assert parse_size("1M") == 2**20 and parse_size("64K") == 2**16 and parse_size("1G") == 2**30
    assert parse_size("1 GiB") == 2**30 and parse_size("2MB") == 2_000_000
    with pytest.raises(ValueError):
        parse_size("3 s")
    assert sizes_between(2**20, 2**30) == [2**k for k in range(20, 31)]  # 1 MiB .. 1 GiB
    all_reduce = result("all_reduce", 8 * 10**9, 1.0, 0.5)
    assert all_reduce.algbw == 8e9 and all_reduce.busbw == 8e9 * 2 * 3 / 4
    assert result("all_gather", 8 * 10**9, 1.0, 1.0).busbw == 8e9 * 3 / 4
    assert result("send_recv", 8 * 10**9, 1.0, 1.0).busbw == 8e9
    assert all_reduce.efficiency == 0.5


@pytest.mark.timeout(10)
def test_an_operation_below_80_percent_at_the_largest_size_flags_its_axis():
    report = CommReport(device="cpu", results=[
        result("all_reduce", 2**10, 1.0, 0.1),   # small sizes do not count
        result("all_reduce", 2**20, 1.0, 0.9),   # 90 %: fine
        result("all_gather", 2**20, 1.0, 0.5)])  # 50 %: flagged
    assert [(r.op, r.size) for r in report.flagged] == [("all_gather", 2**20)]
    console = Console(width=160, record=True)
    console.print(render_comm(report))
    text = console.export_text()
    assert "axis dp: 4 ranks on cpu" in text
    assert "FLAG axis dp: all_gather at 1.0 MiB reaches 50% of the expected" in text


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_bench_comm_measures_every_operation_and_size_on_each_axis():
    report = bench_comm(ckpt_plan(dp=2, zero=0), min_size=4096, max_size=16384, iters=2,
                        warmup=1)
    assert [(r.axis, r.op, r.size) for r in report.results] == [
        ("dp", op, size) for op in OPS for size in (4096, 8192, 16384)]
    assert all(r.ranks == 2 and r.seconds > 0 and r.expected_seconds > 0 for r in report.results)
