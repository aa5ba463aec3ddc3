"""`ptc bench-comm PLAN`: collective bandwidth on every mesh axis, against the plan's hardware.

As nccl-tests' *_perf: on each mesh axis with more than one rank, for each
operation and each message size S from `min_size` to `max_size` (doubling;
1 MiB to 1 GiB by default), the mean time t of `iters` runs after
`warmup` (the slowest rank's), then

- algorithm bandwidth algbw = S / t, where S is the all-reduce buffer, the
  all-gather output, the reduce-scatter input, or the bytes each rank sends
  (send/recv is a ring shift: every rank sends to the next and receives
  from the previous one);
- bus bandwidth busbw = algbw x 2(n-1)/n (all-reduce), x (n-1)/n
  (all-gather, reduce-scatter), x 1 (send/recv): nccl-tests' factors, which
  make busbw comparable with one link's bandwidth whatever n is;
- expected busbw: the same formula applied to the cost model's time for
  that collective on that axis (`ptc.compiler.cost.collectives`: the axis's link —
  NVLink inside a node, InfiniBand across — and the algorithm NCCL would
  pick), and efficiency = busbw / expected busbw.

An axis is flagged when an operation reaches less than `FLAG_BELOW` of its
expected bus bandwidth at the largest size, where bandwidth, not latency,
decides. `bench_comm` starts the plan's processes when it is not already
running inside them; `ptc.views.comm_report.render_comm` lays the results out as tables.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ptc.compiler.cost import collectives as cost
from ptc.compiler.cost.topology import AxisGroup
from ptc.compiler.cost.topology import axis_placements as placement
from ptc.plan import Plan
from ptc.ops.comm import all_gather_flat, all_reduce_flat, reduce_scatter_flat
from ptc.units import UNITS

OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "send_recv": lambda n: 1.0}
FLAG_BELOW = 0.8
MiB, GiB = 2**20, 2**30


@dataclass(frozen=True, slots=True)
class CommResult:
    """One operation at one size on one axis."""

    axis: str
    op: str
    ranks: int
    """Ranks in the axis's group."""
    size: int
    """Message size S in bytes (see the module docstring)."""
    seconds: float
    """Mean time of one operation, slowest rank."""
    expected_seconds: float
    """The cost model's time."""
    algorithm: str
    """The algorithm the cost model assumed."""

    @property
    def algbw(self) -> float:
        """Algorithm bandwidth, bytes/s."""
        return self.size / self.seconds

    @property
    def busbw(self) -> float:
        """Bus bandwidth, bytes/s."""
        return self.algbw * BUS_FACTOR[self.op](self.ranks)

    @property
    def expected_busbw(self) -> float:
        """Bus bandwidth the cost model predicts, bytes/s."""
        return self.size / self.expected_seconds * BUS_FACTOR[self.op](self.ranks)

    @property
    def efficiency(self) -> float:
        """Measured over expected bus bandwidth."""
        return self.busbw / self.expected_busbw


@dataclass
class CommReport:
    """Every measurement, and the (axis, op) pairs below `FLAG_BELOW` of expectations."""

    device: str
    results: list[CommResult] = field(default_factory=list)

    @property
    def flagged(self) -> list[CommResult]:
        """Per axis and operation, the largest size's result when its efficiency is too low."""
        largest: dict[tuple[str, str], CommResult] = {}
        for r in self.results:
            if (r.axis, r.op) not in largest or r.size > largest[(r.axis, r.op)].size:
                largest[(r.axis, r.op)] = r
        return [r for r in largest.values() if r.efficiency < FLAG_BELOW]


def parse_size(text: str) -> int:
    """Bytes of "1G", "64K", "512" (binary suffixes, as nccl-tests) or any byte unit ("1 GiB")."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]*)\s*", text)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 1M, 64KiB, 1G)")
    value, unit = float(match.group(1)), match.group(2)
    scale = {"": 1, "K": 2**10, "M": MiB, "G": GiB}.get(unit)
    if scale is None:
        dimension, scale = UNITS.get(unit, (None, None))
        if dimension != "bytes":
            raise ValueError(f"unknown size unit {unit!r} in {text!r}")
    return int(value * scale)


def sizes_between(min_size: int, max_size: int) -> list[int]:
    """min_size, 2 min_size, ... up to max_size."""
    sizes = []
    size = min_size
    while size <= max_size:
        sizes.append(size)
        size *= 2
    return sizes


def bench_comm(plan: Plan, *, min_size: int = MiB, max_size: int = GiB, iters: int = 20,
               warmup: int = 5) -> CommReport:
    """Measure every operation on every axis of the plan's mesh (starting its processes)."""
    from ptc.runtime.launcher import in_worker, run_local  # noqa: PLC0415
    from ptc.runtime.mesh import world_size  # noqa: PLC0415

    args = (plan, sizes_between(min_size, max_size), iters, warmup)
    if in_worker() or dist.is_initialized():
        return bench_worker(*args)
    return run_local(bench_worker, world_size(plan), *args)[0]


def bench_worker(plan: Plan, sizes: list[int], iters: int, warmup: int) -> CommReport:
    """One rank's part of `bench_comm` (collective over all ranks); rank 0's report is complete."""
    from ptc.runtime.mesh import (  # noqa: PLC0415
        axis_process_groups,
        build_mesh,
        device_for,
        init_distributed,
    )

    created = init_distributed(plan)
    try:
        device = device_for(plan)
        groups = axis_process_groups(build_mesh(plan))
        p = plan.parallel
        places = placement({a: p.degree(a) for a in p.order}, p.order, plan.hardware.gpus_per_node)
        report = CommReport(device=str(device))
        for axis in p.order:
            group, where = groups[axis], places[axis]
            if where.size == 1:
                continue
            for op in OPS:
                for size in sizes:
                    size -= size % (4 * where.size)  # whole fp32 elements per rank
                    seconds = _time(op, size, group, device, iters, warmup)
                    expected = _expected(op, size, where, plan)
                    report.results.append(CommResult(axis, op, where.size, size, seconds,
                                                     expected.seconds, expected.algorithm))
        return report
    finally:
        if created:
            dist.destroy_process_group()


def _expected(op: str, size: int, where: AxisGroup, plan: Plan) -> cost.CommCost:
    return getattr(cost, op)(float(size), where, plan.hardware)


def _time(op: str, size: int, group: dist.ProcessGroup, device: torch.device, iters: int,
          warmup: int) -> float:
    """Mean seconds of one `op` of `size` bytes over `group`, the slowest rank's."""
    n = dist.get_world_size(group)
    run = _operation(op, size // 4, n, group, device)
    for _ in range(warmup):
        run()
    _sync(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        run()
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed)


def _operation(op: str, elements: int, n: int, group: dist.ProcessGroup, device: torch.device):
    """A callable that runs `op` once on preallocated buffers and waits for it."""
    if op == "all_reduce":
        buf = torch.ones(elements, device=device)
        return lambda: all_reduce_flat(buf, group).wait()
    if op == "all_gather":
        mine, out = torch.ones(elements // n, device=device), torch.empty(elements, device=device)
        return lambda: all_gather_flat(mine, group, out=out).wait()
    if op == "reduce_scatter":
        buf = torch.ones(elements, device=device)
        return lambda: reduce_scatter_flat(buf, group).wait()
    send, recv = torch.ones(elements, device=device), torch.empty(elements, device=device)
    me = dist.get_rank(group)
    peers = (dist.get_global_rank(group, (me + 1) % n), dist.get_global_rank(group, (me - 1) % n))

    def shift() -> None:
        ops = [dist.P2POp(dist.isend, send, peers[0], group),
               dist.P2POp(dist.irecv, recv, peers[1], group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return shift


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
