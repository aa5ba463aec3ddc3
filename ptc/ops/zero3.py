"""The life of gathered ZeRO-3 weights over one micro-batch's forward and backward.

Terms: a *gather* is one `gather_params` call, identified by its
`GatherHandle`; its result is the full flat buffer of each of its units.

Forward: autograd would keep every gathered weight alive until backward
(linear saves its weight), which is exactly what ZeRO-3 must not do. The
session's saved-tensor hooks store a reference instead — (gather, unit,
view geometry) — whenever autograd saves a view of a gathered buffer, so a
buffer dies after its last use in the graph.

Backward: the first unpack of a gather's reference re-gathers it (or waits
for the prefetch already in flight), then starts gathering the previous
gather that has saved references — the next one backward will need — so
communication overlaps the current layer's gradient computation. When
`gather_params`'s own backward runs, every use of the gather is done: the
session drops the re-gathered buffers and queues the gradient
reduce-scatter; it waits for one when more than `in_flight` are running (and
for the rest in `finish`) and adds the result into each shard's `.grad`.
How far ahead to prefetch and how many reductions to leave running is the
comm_overlap pass's decision (`ptc.compiler.records.overlap.OverlapPlan`).

Arrivals: with optimizer offload the updated shards come back from host
memory while the next step begins (`ptc.runtime.offload`). The session's
`Arrivals` hold, per shard, how to wait for its copy; the first gather of a
shard waits for it, so early layers compute while later layers' weights are
still on their way, and no gather reads a shard before its update landed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from ptc.ops.session import Session

if TYPE_CHECKING:
    from ptc.ops.collectives import GatherHandle
    from ptc.ops.comm import Piece, Work


def current_session() -> ParamSession | None:
    """The session of the micro-batch being run, if any."""
    return ParamSession.current()


class Arrivals:
    """Copies still landing in ZeRO-3 shards; a shard's first gather waits for its copy."""

    def __init__(self):
        self._waits: dict[int, Callable[[], None]] = {}  # shard storage address -> its wait

    def expect(self, shard: torch.Tensor, wait: Callable[[], None]) -> None:
        """A copy into `shard` is in flight; `wait()` orders device work after it."""
        self._waits[shard.data_ptr()] = wait

    def before_gather(self, shards: Iterable[torch.Tensor]) -> None:
        """Wait for the copies into `shards` still expected (once each)."""
        for shard in shards:
            wait = self._waits.pop(shard.data_ptr(), None)
            if wait is not None:
                wait()

    def clear(self) -> None:
        """Forget every expected copy (their owner waited for them)."""
        self._waits.clear()


class _Ref:
    """A saved view of a gathered buffer, kept as (gather, unit, geometry) instead of data."""

    __slots__ = ("handle", "unit", "offset", "size", "stride")

    def __init__(self, handle: GatherHandle, unit: int, offset: int, size, stride):
        self.handle, self.unit, self.offset = handle, unit, offset
        self.size, self.stride = size, stride


class ParamSession(Session):
    """Saved-tensor hooks, backward re-gather with prefetch, and deferred gradient reductions."""

    def __init__(self, *, prefetch: bool, in_flight: int, arrivals: Arrivals | None = None):
        """`prefetch`: start the next gather backward needs as soon as one arrives;
        `in_flight`: gradient reduce-scatters left running while backward goes on;
        `arrivals`: copies into the shards that their first gather must wait for."""
        self.prefetch, self.in_flight, self.arrivals = prefetch, in_flight, arrivals
        self._live: dict[int, tuple[weakref.ref, GatherHandle, int]] = {}
        self._saved: list[GatherHandle] = []  # gathers with saved references, forward order
        self._full: dict[int, list[torch.Tensor]] = {}  # id(handle) -> re-gathered buffers
        self._released: set[int] = set()
        self._deferred: list[tuple[GatherHandle, list[Work | Piece]]] = []

    def before_gather(self, shards: Iterable[torch.Tensor]) -> None:
        """Called by a gather before it reads `shards`: wait for copies still landing there."""
        if self.arrivals is not None:
            self.arrivals.before_gather(shards)

    def saved_tensor_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks to run the forward under."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def track(self, handle: GatherHandle, flats: list[torch.Tensor]) -> None:
        """Remember that `flats` are the buffers of `handle` (called by gather_params)."""
        for unit, flat in enumerate(flats):
            self._live[id(flat)] = (weakref.ref(flat), handle, unit)

    def alive(self) -> int:
        """How many buffers gathered in forward are still alive (0 after forward: by design)."""
        return sum(ref() is not None for ref, _, _ in self._live.values())

    def release(self, handle: GatherHandle) -> None:
        """Drop `handle`'s re-gathered buffers: backward is done with them."""
        self._full.pop(id(handle), None)
        self._released.add(id(handle))

    def defer(self, handle: GatherHandle, works: list[Work | Piece]) -> None:
        """Queue `handle`'s gradient reduce-scatters; complete all but the last `in_flight`."""
        self._deferred.append((handle, works))
        while len(self._deferred) > self.in_flight:
            self._complete(*self._deferred.pop(0))

    def finish(self) -> None:
        """Complete every gradient reduce-scatter still in flight; end the micro-batch."""
        for handle, works in self._deferred:
            self._complete(handle, works)
        self._deferred.clear()
        self._full.clear()
        self._live.clear()

    @staticmethod
    def _complete(handle: GatherHandle, works: list[Work | Piece]) -> None:
        with torch.no_grad():
            for shard, work in zip(handle.shards, works):
                grad = work.wait()
                if shard.grad is None:
                    shard.grad = grad.clone()
                else:
                    shard.grad.add_(grad)

    def _pack(self, tensor: torch.Tensor):
        base = tensor._base if tensor._base is not None else tensor
        entry = self._live.get(id(base))
        if entry is None or entry[0]() is not base:  # not a gathered buffer (or a stale id)
            return tensor
        _, handle, unit = entry
        if not any(h is handle for h in self._saved):
            self._saved.append(handle)
        return _Ref(handle, unit, tensor.storage_offset() - base.storage_offset(),
                    tensor.size(), tensor.stride())

    def _unpack(self, saved):
        if not isinstance(saved, _Ref):
            return saved
        flat = self._regather(saved.handle)[saved.unit]
        return flat.as_strided(saved.size, saved.stride, flat.storage_offset() + saved.offset)

    def _regather(self, handle: GatherHandle) -> list[torch.Tensor]:
        flats = self._full.get(id(handle))
        if flats is None:
            if not handle.started:
                handle.start()
            flats = self._full[id(handle)] = handle.wait()
            if self.prefetch:
                self._prefetch_before(handle)
        return flats

    def _prefetch_before(self, handle: GatherHandle) -> None:
        index = next(i for i, h in enumerate(self._saved) if h is handle)
        for previous in reversed(self._saved[:index]):
            key = id(previous)
            if key in self._released or key in self._full:
                continue
            if not previous.started:
                previous.start()
            return
