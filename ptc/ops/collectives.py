"""Autograd-aware collective ops that lowered graphs call.

ZeRO-3's gather is split in two graph nodes so that the zero pass can issue
the next layer's gather before the current layer computes (prefetch):

- `gather_params_start(shards, axis, dtype)` starts all-gathering the shards
  of one or more units over `axis`, cast to the compute dtype, and returns a
  `GatherHandle`. It only moves data: no gradient flows through it.
- `gather_params(handle, shards)` waits for that gather and returns each
  unit's full flat buffer. Backward: the gradient of each full buffer is
  reduce-scattered (summed) over the axis in fp32, so each rank receives the
  gradient of its own shard.

Between forward and backward only the shards persist: under a
`ParamSession` (ptc.ops.zero3) autograd saves gathered weights by
reference and re-gathers them in backward, and the reduce-scatter runs
asynchronously while backward continues; the session adds its result into
each shard's `.grad`. Without a session (a graph run by hand) the weights
are saved as usual and the gradient is returned to autograd directly.
"""

from __future__ import annotations

import torch

from ptc.ops.comm import Piece, Work, all_gather_bucket, axis_group, group_size, \
    reduce_scatter_bucket
from ptc.ops.zero3 import current_session


class GatherHandle:
    """One `gather_params_start`: the shards it gathers and the collectives in flight.

    A handle is also the identity of its gather: the session re-gathers the
    same shards through it in backward. Several units (a bucket, see the
    comm_overlap pass) travel as one collective each way.
    """

    def __init__(self, shards: tuple[torch.Tensor, ...], axis: str, dtype: torch.dtype):
        self.shards = shards
        self.axis = axis
        self.dtype = dtype
        self._works: list[Work | Piece] | None = None

    @property
    def started(self) -> bool:
        """Whether a gather is in flight (started and not yet waited for)."""
        return self._works is not None

    def start(self) -> None:
        """Issue the asynchronous all-gather of every unit's shard (one collective), after
        any copy still landing in a shard (`ptc.ops.zero3.Arrivals`)."""
        session = current_session()
        if session is not None:
            session.before_gather(self.shards)
        group = axis_group(self.axis)
        with torch.no_grad():
            self._works = all_gather_bucket([s.detach().to(self.dtype) for s in self.shards],
                                            group)

    def wait(self) -> list[torch.Tensor]:
        """Block until gathered; return each unit's full flat buffer (padded length)."""
        works, self._works = self._works, None
        return [w.wait() for w in works]

    def reduce_grads(self, grads: tuple[torch.Tensor | None, ...]) -> list[Work | Piece]:
        """Start reduce-scattering every unit's full-buffer gradient (fp32) over the axis."""
        group = axis_group(self.axis)
        world = group_size(group)
        flats = []
        for shard, grad in zip(self.shards, grads):
            if grad is None:  # a unit whose weights got no gradient in this backward
                grad = torch.zeros(shard.numel() * world, dtype=torch.float32, device=shard.device)
            flats.append(grad.to(torch.float32).contiguous())
        return reduce_scatter_bucket(flats, group)


class _GatherParams(torch.autograd.Function):
    @staticmethod
    def forward(ctx, handle: GatherHandle, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        flats = handle.wait()
        ctx.handle = handle
        session = current_session()
        if session is not None:
            session.track(handle, flats)
        return tuple(flats)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        handle: GatherHandle = ctx.handle
        works = handle.reduce_grads(grads)
        session = current_session()
        if session is None:
            return (None, *(w.wait() for w in works))
        session.release(handle)
        session.defer(handle, works)
        return (None,) * (1 + len(handle.shards))


def gather_params_start(shards: tuple[torch.Tensor, ...], axis: str = "dp",
                        dtype: torch.dtype = torch.float32) -> GatherHandle:
    """Start all-gathering `shards` (one per unit) over `axis`, cast to `dtype`.

    Forward: asynchronous all-gather; returns the handle `gather_params` waits on.
    Backward: none (not differentiable; the gradient flows through `gather_params`).
    """
    handle = GatherHandle(tuple(shards), axis, dtype)
    handle.start()
    return handle


def gather_params(handle: GatherHandle,
                  shards: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Wait for `handle`'s gather; return the full flat buffer of each unit of `shards`.

    Forward: wait for the all-gather. Backward: reduce-scatter (sum, fp32) each
    buffer's gradient over the axis into the gradient of the rank's shard.
    """
    return _GatherParams.apply(handle, *shards)


# What `ptc.views.inspect` shows for these ops (it reads this attribute, not the runtime).
gather_params_start.ptc_collective = ("all-gather (start)", "none")
gather_params.ptc_collective = ("all-gather (wait)", "reduce-scatter")
