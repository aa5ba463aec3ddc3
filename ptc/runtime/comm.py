"""Process groups by axis name, and the asynchronous flat collectives the runtime issues.

Lowered graphs name a mesh *axis* ("dp"), never a process group: the
compiler has none. The executor binds axis names to the groups of its
DeviceMesh with `bind_axes`; ops look them up with `axis_group`. An unbound
axis, or a group of one rank, makes every collective a local no-op, so a
lowered graph also runs in a plain single process.

Every collective here is issued with `async_op=True` and returns a `Work`
to wait on later: that is what lets gathers and gradient reductions overlap
computation. All ranks issue collectives on a group in the same order
(the graphs and autograd's order are the same on every rank), as gloo and
NCCL require.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.distributed as dist

_GROUPS: dict[str, dist.ProcessGroup | None] = {}

# The *_single names replace the deprecated *_into_tensor / *_tensor ones in recent torch.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@contextmanager
def bind_axes(groups: Mapping[str, dist.ProcessGroup | None]) -> Iterator[None]:
    """Make `axis_group(name)` return `groups[name]` inside the block."""
    saved = dict(_GROUPS)
    _GROUPS.update(groups)
    try:
        yield
    finally:
        _GROUPS.clear()
        _GROUPS.update(saved)


def axis_group(axis: str) -> dist.ProcessGroup | None:
    """The process group bound to `axis`, or None when unbound (single process)."""
    return _GROUPS.get(axis)


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in `group` (1 for None)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside `group` (0 for None)."""
    return 0 if group is None else dist.get_rank(group)


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
            self._work.wait()
            self._work = None
        self._keep = None
        return self.output


def all_gather_flat(flat: torch.Tensor, group: dist.ProcessGroup | None,
                    out: torch.Tensor | None = None) -> Work:
    """Start gathering each rank's 1-D `flat` into one [world * n] tensor (rank order).

    `out`, when given, receives the result (it must not alias `flat`).
    """
    world = group_size(group)
    if world == 1:
        return Work(None, flat if out is None else out.copy_(flat))
    if out is None:
        out = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
    return Work(_all_gather(out, flat, group=group, async_op=True), out, flat)


def reduce_scatter_flat(flat: torch.Tensor, group: dist.ProcessGroup | None) -> Work:
    """Start summing 1-D `flat` [world * n] over ranks; rank r keeps elements [r*n, (r+1)*n)."""
    world = group_size(group)
    if world == 1:
        return Work(None, flat)
    out = torch.empty(flat.numel() // world, dtype=flat.dtype, device=flat.device)
    return Work(_reduce_scatter(out, flat, group=group, async_op=True), out, flat)


def all_reduce_flat(flat: torch.Tensor, group: dist.ProcessGroup | None) -> Work:
    """Start summing `flat` over ranks in place."""
    if group_size(group) == 1:
        return Work(None, flat)
    return Work(dist.all_reduce(flat, group=group, async_op=True), flat)
