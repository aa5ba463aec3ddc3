"""Gradient reduction over dp for ZeRO 0-2, overlapped with backward, bucket by bucket.

A hook on every graph parameter moves its gradient, as soon as autograd has
accumulated it, into the unit's fp32 buffer and frees it — or, at ZeRO 0-1
with fp32 weights, autograd accumulates straight into that buffer: each
parameter's `.grad` is a view of its slice (DDP's `gradient_as_bucket_view`),
the same additions without the copy, and the hook only counts. When the last
parameter of a *bucket* (consecutive units, chosen by the comm_overlap pass:
`ptc.compiler.records.overlap.OverlapPlan`) is in, the bucket's reduction starts
asynchronously — one collective for all its units — while backward goes on
with earlier layers:

- ZeRO-0: all-reduce (sum) of the bucket's full gradient buffers, only
  after the last micro-batch of the step — earlier micro-batches just
  accumulate. With a `FoldedGuard` (pure data parallel) the step's last
  all-reduce also carries the non-finite guard's slots
  (`ptc.runtime.health`), so the guard issues no collective of its own.
- ZeRO-1: the same accumulation, then a reduce-scatter (sum) of the full
  buffers into the part of each buffer this rank updates (its shard): half
  an all-reduce's bytes, as Megatron-LM's distributed optimizer. The rest of
  the buffer keeps this rank's own sums, which nothing reads (the clip, the
  optimizer and `fill_main_grads` read the shard).
- ZeRO-2: reduce-scatter (sum) of this micro-batch's full gradients of the
  bucket's units, added into the rank's shard of each unit's gradient; the
  full gradients are freed, so between micro-batches only shards are held.

With `parallel.grad_comm = fp8` both travel as float8 with a scale per bucket
and rank, summed in fp32 on arrival (`ptc.ops.fp8_comm`).

The loss each micro-batch differentiates is already divided by dp times the
number of micro-batches, so sums are means. At most `in_flight` reductions
run behind backward (ZeRO-2's each hold a bucket's full gradients; 0 waits
for each at once, no overlap). `finish` reduces buckets that got no
gradient (so every rank issues the same collectives) and waits for all.
"""

from __future__ import annotations

import torch

from ptc.compiler.records.overlap import OverlapPlan
from ptc.ops.comm import Piece, Waitable, all_reduce_bucket, reduce_scatter_bucket
from ptc.ops.fp8_comm import FORMATS, fp8_reduction
from ptc.runtime.health import FoldedGuard
from ptc.runtime.params import UnitState


class GradReducer:
    """Per-bucket gradient buffers with asynchronous reduction (ZeRO 0-2)."""

    def __init__(self, units: list[UnitState], zero: int, overlap: OverlapPlan,
                 grad_dtype: torch.dtype = torch.float32, grad_comm: str = "none",
                 guard: FoldedGuard | None = None):
        """`grad_dtype`: what a ZeRO-2 micro-batch's gradients are summed and reduce-scattered
        in (train.grad_dtype); ZeRO 0-1 buffers carry their own dtype. `grad_comm`: "none",
        or the float8 format the reductions move (parallel.grad_comm, `ptc.ops.fp8_comm`).
        `guard`: the non-finite guard the ZeRO-0 all-reduces carry (fp32 buffers and
        reductions, every unit's group every rank of the job). Each unit is reduced over its
        own group (`UnitState.group`): a bucket's units of one group go in one collective."""
        self.units, self.zero = units, zero
        self.grad_dtype = grad_dtype
        fmt = FORMATS.get(grad_comm)
        self._all_reduce = fp8_reduction(fmt, everywhere=True) if fmt is not None else None
        self._reduce_scatter = fp8_reduction(fmt, everywhere=False) if fmt is not None else None
        if guard is not None and (zero != 0 or fmt is not None):
            raise ValueError("the non-finite guard rides only ZeRO-0's fp32 all-reduces")
        self.guard = guard
        self.buckets = overlap.buckets
        self.in_flight = overlap.in_flight
        self._bucket_of = {u: b for b, bucket in enumerate(self.buckets) for u in bucket}
        self._parts = [self._by_group(bucket) for bucket in self.buckets]
        """Per bucket, its units by the group they are reduced over (one collective each)."""
        # Frozen parameters (requires_grad = False) get no gradient, so no hook: not counted.
        self._expected = [sum(p.requires_grad for u in bucket for p in units[u].params)
                          for bucket in self.buckets]
        self._reduce = True
        self._ready = [0] * len(self.buckets)
        self._flushed = [False] * len(self.buckets)
        self._micro: dict[int, torch.Tensor] = {}  # ZeRO-2: this micro-batch's full gradients
        self._works: list[tuple[int, list[Waitable | Piece]]] = []
        for index, unit in enumerate(units):
            for slot, param in zip(unit.slots, unit.params):
                if not param.requires_grad:
                    continue
                in_place = zero < 2 and param.dtype == unit.grad.dtype
                if in_place:  # autograd adds into the existing .grad in place
                    param.grad = unit.grad[slot.offset:slot.offset + slot.numel].view(param.shape)
                param.register_post_accumulate_grad_hook(
                    self._count(index) if in_place else self._hook(index, slot.offset, slot.numel))

    def begin(self, last_micro: bool) -> None:
        """Prepare for one micro-batch's backward; ZeRO 0-1 reduce only after the last."""
        self._reduce = last_micro or self.zero == 2
        self._ready = [0] * len(self.buckets)
        self._flushed = [False] * len(self.buckets)

    def _hook(self, index: int, offset: int, numel: int):
        """Move the accumulated gradient into unit `index`'s buffer at `offset`, then count it."""
        count = self._count(index)

        def on_grad(param: torch.Tensor) -> None:
            buffer = self._buffer(index)
            buffer[offset:offset + numel].view(param.shape).add_(param.grad)
            param.grad = None
            count(param)
        return on_grad

    def _count(self, index: int):
        """Count one more gradient of unit `index` in; start its bucket's reduction when full."""
        bucket = self._bucket_of[index]

        def on_grad(param: torch.Tensor) -> None:
            self._ready[bucket] += 1
            if self._ready[bucket] == self._expected[bucket]:
                self._flush(bucket)
        return on_grad

    def _buffer(self, index: int) -> torch.Tensor:
        unit = self.units[index]
        if self.zero < 2:
            return unit.grad
        if index not in self._micro:
            self._micro[index] = torch.zeros(unit.spec.padded_numel, dtype=self.grad_dtype,
                                             device=unit.grad.device)
        return self._micro[index]

    def _flush(self, bucket: int) -> None:
        if self._flushed[bucket] or not self._reduce:
            return
        self._flushed[bucket] = True
        members = self._parts[bucket]
        works: list[Waitable | Piece] = []
        for index, part in enumerate(members):
            group = self.units[part[0]].group
            if self.zero == 0:
                flats = [self.units[u].grad for u in part]
                if self.guard is not None:
                    self.guard.see(flats)
                    if all(self._flushed) and index == len(members) - 1:
                        flats.append(self.guard.slots())  # the step's last: the slots ride it
                works += all_reduce_bucket(flats, group, self._all_reduce)
            elif self.zero == 1:
                works += reduce_scatter_bucket([self.units[u].grad for u in part], group,
                                               self._reduce_scatter)
            else:
                works += reduce_scatter_bucket([self._buffer(u) for u in part], group,
                                               self._reduce_scatter)
                for u in part:
                    del self._micro[u]
        self._works.append((bucket, works))
        while len(self._works) > self.in_flight:
            self._complete(*self._works.pop(0))

    def _by_group(self, bucket: tuple[int, ...]) -> list[list[int]]:
        """The bucket's units by the group they are reduced over, in bucket order (an expert
        unit's group is not dp's: `UnitState.group`)."""
        parts: dict[int, list[int]] = {}
        for u in bucket:
            parts.setdefault(id(self.units[u].group), []).append(u)
        return list(parts.values())

    def finish(self) -> None:
        """Reduce the buckets that got no gradient, wait for every reduction, fill shard grads."""
        for bucket in range(len(self.buckets)):
            self._flush(bucket)
        for bucket, works in self._works:
            self._complete(bucket, works)
        self._works.clear()

    def _complete(self, bucket: int, works: list[Waitable | Piece]) -> None:
        order = [u for part in self._parts[bucket] for u in part]
        with torch.no_grad():
            for unit, work in zip(order, works):
                out = work.wait()  # ZeRO-0: summed in the unit's own gradient buffer
                state = self.units[unit]
                if self.zero == 1:
                    state.grad.view(state.world, -1)[state.rank].copy_(out)
                elif self.zero == 2:
                    state.grad.add_(out)
            for work in works[len(order):]:  # the guard's slots, summed in place
                work.wait()
