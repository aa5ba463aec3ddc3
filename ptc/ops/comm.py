"""Process groups by axis name, and the asynchronous flat collectives the runtime issues.

Lowered graphs name a mesh *axis* ("dp"), never a process group: the
compiler has none. The executor binds axis names to the groups of its
DeviceMesh with `bind_axes`; ops look them up with `axis_group`. An unbound
axis, or a group of one rank, makes every collective a local no-op, so a
lowered graph also runs in a plain single process. A `ShapeGroup` stands in
for a group of n ranks on meta tensors: its collectives return outputs of
the shape n ranks would give and move nothing (`ptc.lower.verify` re-runs
lowered graphs on the meta device so).

Every collective here is issued with `async_op=True` and returns a `Work`
to wait on later: that is what lets gathers and gradient reductions overlap
computation. All ranks issue collectives on a group in the same order
(the graphs and autograd's order are the same on every rank), as gloo and
NCCL require.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch
import torch.distributed as dist



class ShapeGroup:
    """A stand-in for a process group of `size` ranks, this process being rank 0: its
    collectives give results of the right shape (meta tensors) and communicate nothing."""

    def __init__(self, size: int):
        self.size = size

    def __repr__(self) -> str:
        return f"ShapeGroup({self.size})"


Group = dist.ProcessGroup | ShapeGroup | None
"""What an axis is bound to: a process group, a shape stand-in, or nothing (one rank)."""

_GROUPS: dict[str, Group] = {}

# The *_single names replace the deprecated *_into_tensor / *_tensor ones in recent torch.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@contextmanager
def bind_axes(groups: Mapping[str, Group]) -> Iterator[None]:
    """Make `axis_group(name)` return `groups[name]` inside the block."""
    saved = dict(_GROUPS)
    _GROUPS.update(groups)
    try:
        yield
    finally:
        _GROUPS.clear()
        _GROUPS.update(saved)


def axis_group(axis: str) -> Group:
    """The process group bound to `axis`, or None when unbound (single process)."""
    return _GROUPS.get(axis)


def group_size(group: Group) -> int:
    """Ranks in `group` (1 for None)."""
    if isinstance(group, ShapeGroup):
        return group.size
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This process's rank inside `group` (0 for None and for a ShapeGroup)."""
    return 0 if group is None or isinstance(group, ShapeGroup) else dist.get_rank(group)


_RECORD: list[list[tuple[str, tuple[int, ...], int, int]]] = []
"""Open `record_collectives` logs."""


@contextmanager
def record_collectives() -> Iterator[list[tuple[str, tuple[int, ...], int, int]]]:
    """Log every collective issued inside the block: (op, group ranks, elements, bytes sent).

    Ranks of one group must issue the same sequence, or gloo and NCCL hang or
    mix up data; tests compare the logs of all ranks.
    """
    log: list[tuple[str, tuple[int, ...], int, int]] = []
    _RECORD.append(log)
    try:
        yield log
    finally:
        _RECORD.remove(log)


def note(op: str, group: Group, sent: torch.Tensor) -> None:
    """Log a collective this process issues with `sent` as its input in the open
    `record_collectives` logs, as (op, group ranks, elements, bytes)."""
    if _RECORD and not isinstance(group, ShapeGroup):
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        for log in _RECORD:
            log.append((op, ranks, sent.numel(), sent.numel() * sent.element_size()))


_WAITED = [0.0]
"""Seconds this process has spent blocked in `Work.wait` (see `comm_wait_seconds`)."""

_GPU_STALLS: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
"""(before, after) events around each wait on a GPU, not yet added to `_WAITED`."""


def comm_wait_seconds() -> float:
    """Seconds spent blocked waiting for collectives so far: the communication compute did
    not hide (exposed). Sample it before and after a step; the difference is that step's.

    On the CPU (gloo) a wait blocks the thread, so its wall time is the stall. On a GPU
    (NCCL) `wait()` returns at once and only makes the compute stream wait for the
    communication stream; the stall is then the time between an event recorded on the
    compute stream just before the wait and one just after it, read here (which waits for
    the later events to complete: sample it where the step synchronises anyway)."""
    while _GPU_STALLS:
        before, after = _GPU_STALLS.pop()
        after.synchronize()
        _WAITED[0] += before.elapsed_time(after) / 1000.0  # elapsed_time is in milliseconds
    return _WAITED[0]


class Work:
    """A collective in flight: `wait()` blocks until its output tensor is ready."""

    __slots__ = ("_work", "output", "_keep")

    def __init__(self, work, output: torch.Tensor, keep: torch.Tensor | None = None):
        self._work = work
        self.output = output
        self._keep = keep  # the input must stay alive until the collective finishes

    def wait(self) -> torch.Tensor:
        """Block until done; return the output."""
        if self._work is not None:
            if self.output.is_cuda:
                before, after = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                before.record()
                self._work.wait()
                after.record()
                _GPU_STALLS.append((before, after))
            else:
                began = time.perf_counter()
                self._work.wait()
                _WAITED[0] += time.perf_counter() - began
            self._work = None
        self._keep = None
        return self.output


class Waitable(Protocol):
    """A collective in flight: `wait()` blocks until done and returns its output."""

    def wait(self) -> torch.Tensor: ...


FlatCollective = Callable[[torch.Tensor, Group], Waitable]
"""A collective over one flat buffer that starts at once and is waited on later."""


class Piece:
    """One unit's share of a bucketed collective: `wait()` gives that unit's output.

    The bucket's collective is waited once (by whichever piece asks first); `take`
    maps the bucket's output to this unit's tensor.
    """

    __slots__ = ("_work", "_take")

    def __init__(self, work: Waitable, take):
        self._work, self._take = work, take

    def wait(self) -> torch.Tensor:
        """Block until the bucket's collective is done; return this unit's part."""
        return self._take(self._work.wait())


def all_gather_bucket(flats: Sequence[torch.Tensor], group: Group
                      ) -> list[Work | Piece]:
    """Start gathering several units' shards with one collective; one waitable per unit.

    Rank r sends its shards back to back, so the gathered buffer is
    [world, sum of shard lengths]; each unit's full buffer is its column
    range, copied out in rank order (what `all_gather_flat` gives per unit).
    """
    if len(flats) == 1 or group_size(group) == 1:
        return [all_gather_flat(f, group) for f in flats]
    world, bounds = group_size(group), _bounds([f.numel() for f in flats])
    work = all_gather_flat(torch.cat(list(flats)), group)
    return [Piece(work, lambda out, a=a, b=b: out.view(world, -1)[:, a:b].reshape(-1))
            for a, b in bounds]


def reduce_scatter_bucket(flats: Sequence[torch.Tensor], group: Group,
                          reduce_scatter: FlatCollective | None = None) -> list[Work | Piece]:
    """Start reduce-scattering several units' full buffers [world * n_i] with one collective.

    Each buffer is laid out by destination rank; concatenating their
    [world, n_i] views along the second dimension keeps that layout for
    the bucket, so rank r receives every unit's shard r back to back.
    `reduce_scatter`: the flat collective to use (default `reduce_scatter_flat`).
    """
    reduce_scatter = reduce_scatter or reduce_scatter_flat
    if len(flats) == 1 or group_size(group) == 1:
        return [reduce_scatter(f, group) for f in flats]
    world = group_size(group)
    bounds = _bounds([f.numel() // world for f in flats])
    work = reduce_scatter(torch.cat([f.view(world, -1) for f in flats], dim=1).view(-1), group)
    return [Piece(work, lambda out, a=a, b=b: out[a:b]) for a, b in bounds]


def all_reduce_bucket(flats: Sequence[torch.Tensor], group: Group,
                      all_reduce: FlatCollective | None = None) -> list[Work | Piece]:
    """Start summing several buffers over ranks with one collective; one waitable per buffer.

    The buffers are concatenated; waiting on a buffer's piece copies its sum
    back into it (in place, as `all_reduce_flat` leaves it). `all_reduce`: the
    flat collective to use (default `all_reduce_flat`).
    """
    all_reduce = all_reduce or all_reduce_flat
    if len(flats) == 1 or group_size(group) == 1:
        return [all_reduce(f, group) for f in flats]
    work = all_reduce(torch.cat(list(flats)), group)
    return [Piece(work, lambda out, flat=flat, a=a, b=b: flat.copy_(out[a:b]))
            for flat, (a, b) in zip(flats, _bounds([f.numel() for f in flats]))]


def _bounds(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of each of consecutive pieces of the given lengths."""
    ends = list(itertools.accumulate(lengths))
    return [(end - n, end) for n, end in zip(lengths, ends)]


def all_gather_flat(flat: torch.Tensor, group: Group,
                    out: torch.Tensor | None = None) -> Work:
    """Start gathering each rank's 1-D `flat` into one [world * n] tensor (rank order).

    `out`, when given, receives the result (it must not alias `flat`).
    """
    world = group_size(group)
    if world == 1:
        return Work(None, flat if out is None else out.copy_(flat))
    note("all_gather", group, flat)
    if out is None:
        out = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
    if isinstance(group, ShapeGroup):
        return Work(None, out)
    return Work(_all_gather(out, flat, group=group, async_op=True), out, flat)


def reduce_scatter_flat(flat: torch.Tensor, group: Group,
                        out: torch.Tensor | None = None) -> Work:
    """Start summing 1-D `flat` [world * n] over ranks; rank r keeps elements [r*n, (r+1)*n).

    `out`, when given, receives the result (it must not alias `flat`).
    """
    world = group_size(group)
    if world == 1:
        return Work(None, flat if out is None else out.copy_(flat))
    note("reduce_scatter", group, flat)
    if out is None:
        out = torch.empty(flat.numel() // world, dtype=flat.dtype, device=flat.device)
    if isinstance(group, ShapeGroup):
        return Work(None, out)
    return Work(_reduce_scatter(out, flat, group=group, async_op=True), out, flat)


def all_reduce_flat(flat: torch.Tensor, group: Group,
                    op: dist.ReduceOp = dist.ReduceOp.SUM) -> Work:
    """Start reducing `flat` over ranks in place (sum unless `op` says otherwise)."""
    if group_size(group) == 1:
        return Work(None, flat)
    note("all_reduce", group, flat)
    if isinstance(group, ShapeGroup):
        return Work(None, flat)
    return Work(dist.all_reduce(flat, op=op, group=group, async_op=True), flat)
