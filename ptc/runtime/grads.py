"""Gradient reduction over dp for ZeRO 0-2, overlapped with backward: one bucket per unit.

A hook on every graph parameter moves its gradient, as soon as autograd has
accumulated it, into the unit's fp32 buffer and frees it. When the last
parameter of a unit is in, the unit's reduction starts asynchronously while
backward goes on with earlier layers:

- ZeRO 0-1: all-reduce (sum) of the unit's full gradient buffer, only after
  the last micro-batch of the step — earlier micro-batches just accumulate.
- ZeRO-2: reduce-scatter (sum) of this micro-batch's full gradients of the
  unit, added into the rank's shard of the gradient; the full gradients are
  freed, so between micro-batches only shards are held.

The loss each micro-batch differentiates is already divided by dp times the
number of micro-batches, so sums are means. At most `IN_FLIGHT` reductions
run behind backward (ZeRO-2's each hold a unit's full gradient). `finish`
reduces units that got no gradient (so every rank issues the same
collectives) and waits for all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ptc.runtime.comm import Work, all_reduce_flat, reduce_scatter_flat
from ptc.runtime.params import UnitState
from ptc.runtime.zero3 import IN_FLIGHT


class GradReducer:
    """Per-unit gradient buckets with asynchronous reduction (ZeRO 0-2)."""

    def __init__(self, units: list[UnitState], group: dist.ProcessGroup | None, zero: int):
        self.units, self.group, self.zero = units, group, zero
        self._reduce = True
        self._ready = [0] * len(units)
        self._flushed = [False] * len(units)
        self._micro: dict[int, torch.Tensor] = {}  # ZeRO-2: this micro-batch's full gradients
        self._works: list[tuple[int, Work]] = []
        for index, unit in enumerate(units):
            for slot, param in zip(unit.slots, unit.params):
                param.register_post_accumulate_grad_hook(self._hook(index, slot.offset, slot.numel))

    def begin(self, last_micro: bool) -> None:
        """Prepare for one micro-batch's backward; ZeRO 0-1 reduce only after the last."""
        self._reduce = last_micro or self.zero == 2
        self._ready = [0] * len(self.units)
        self._flushed = [False] * len(self.units)

    def _hook(self, index: int, offset: int, numel: int):
        def on_grad(param: torch.Tensor) -> None:
            buffer = self._buffer(index)
            buffer[offset:offset + numel].view(param.shape).add_(param.grad)
            param.grad = None
            self._ready[index] += 1
            if self._ready[index] == len(self.units[index].params):
                self._flush(index)
        return on_grad

    def _buffer(self, index: int) -> torch.Tensor:
        unit = self.units[index]
        if self.zero < 2:
            return unit.grad
        if index not in self._micro:
            self._micro[index] = torch.zeros(unit.spec.padded_numel, dtype=torch.float32,
                                             device=unit.grad.device)
        return self._micro[index]

    def _flush(self, index: int) -> None:
        if self._flushed[index] or not self._reduce:
            return
        self._flushed[index] = True
        if self.zero < 2:
            self._works.append((index, all_reduce_flat(self.units[index].grad, self.group)))
        else:
            self._works.append((index, reduce_scatter_flat(self._buffer(index), self.group)))
            del self._micro[index]
        while len(self._works) > IN_FLIGHT:
            self._complete(*self._works.pop(0))

    def finish(self) -> None:
        """Reduce the units that got no gradient, wait for every reduction, fill shard grads."""
        for index in range(len(self.units)):
            self._flush(index)
        for index, work in self._works:
            self._complete(index, work)
        self._works.clear()

    def _complete(self, index: int, work: Work) -> None:
        out = work.wait()
        if self.zero == 2:
            with torch.no_grad():
                self.units[index].grad.add_(out)
