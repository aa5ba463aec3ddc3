"""Optimizer offload (`parallel.offload = optimizer`): masters, moments and the step on the host.

Terms: the *device* is where the rank's graphs run and its gradients are
reduced (a GPU, or the CPU in tests); the *host* is CPU memory, pinned when
the device is a GPU so that copies run asynchronously at the link's rate.
A *unit* (`ptc.runtime.params.UnitState`) is the group the update moves
and steps at once: a layer's parameters, the embedding, the head.

`offload_masters` moves what the optimizer updates off the device: each
unit's `master` becomes an fp32 host tensor, with an fp32 host gradient as
its `.grad`, so torch's AdamW creates its moments beside it and steps on
the CPU. The device keeps what the graph needs: its weights (ZeRO 1-2: the
unit's full buffer; ZeRO-3: the fp32 shard the graph gathers, then held in
`UnitState.shard`) and the gradient accumulators the reductions fill. With
16-bit weights at ZeRO 1-2 the device's fp32 master copy is freed; the
optimizer's moments never reach it.

`HostOptimizer.update` runs the step as ZeRO-Offload does, a pipeline
over the units on two copy lanes (`ptc.runtime.host_copies`) and the CPU:

    down lane (device → host)   g0  g1  g2  g3
    CPU (clip, AdamW)               s0  s1  s2  s3
    up lane (host → device)             w0  w1  w2  w3

1. every unit's reduced fp32 gradient (the part this rank updates) is
   queued down into its host `.grad` at once;
2. meanwhile the device takes the global norm and the clip factor of the
   same gradients where they lie (`ShardedOptimizer.clip_factor`): the
   step needs the factor before its first unit, not every gradient on the
   host;
3. unit by unit, in order: wait for its gradient, clip it, step its master
   (`ShardedOptimizer.step(lr, unit=i)`), queue the new weights up into
   `params.weight_shard` — so the gradient of unit i+1 travels down and the
   weights of unit i-1 up while the CPU steps unit i. With 16-bit weights
   the CPU casts the master first (as the device would: round to nearest
   even) into the unit's host gradient, free until the next step, and half
   the bytes travel;
4. the weights' first reader waits for their copy: at ZeRO 1-2 the unit's
   all-gather of the full buffer, issued right after its copy; at ZeRO-3
   the unit's first gather in the next forward (`ptc.ops.zero3.Arrivals`),
   so the next step's early layers compute while the last units' weights
   are still on their way.

What a copy reads is not overwritten before it lands: a unit's next
gradient goes down into its host `.grad` after its weights (cast there)
went up, and the CPU writes a master only after its gradient arrived,
which is after the previous step's copy of it (same unit, later queue).
`settle` waits for every copy (a checkpoint restore writes the masters).

The arithmetic is the non-offloaded run's: the same fp32 gradients, norm
(taken on the device, as without offload), clip factor and AdamW on the
same fp32 values. On a CPU device it is the same computation bit for bit;
on a GPU the CPU's Adam kernel rounds as torch's CPU kernels do, which may
differ from its CUDA kernels in the last bit.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ptc.ops.comm import Work
from ptc.ops.zero3 import Arrivals
from ptc.runtime.host_copies import Landing, Lane
from ptc.runtime.optimizer import ShardedOptimizer
from ptc.runtime.params import UnitState, gather_full, weight_shard


class HostOptimizer:
    """The offloaded update of a rank's units: the gradients they step from on the device, the
    copy lanes, and the copies of new weights still in flight."""

    def __init__(self, units: list[UnitState], sources: list[torch.Tensor],
                 device: torch.device):
        """`units` whose masters are on the host; `sources[i]` the device fp32 gradient of
        what unit i's master updates (made by `offload_masters`)."""
        self.units, self.sources, self.device = units, sources, device
        self.down, self.up = Lane(device), Lane(device)
        self.sent: list[Landing | None] = [None] * len(units)
        """Per unit, the copy of its latest weights to the device."""
        self.arrivals = Arrivals()
        """ZeRO-3: the sent weights the next forward's gathers wait for."""

    def update(self, optimizer: ShardedOptimizer, lr: float, max_norm: float | None,
               squared_norm: torch.Tensor) -> float:
        """Clip, step and publish every unit (the module docstring); the norm before the clip.

        Call after the step's reductions, where the non-offloaded run clips
        and steps; `squared_norm`: the job's sum of `ShardedOptimizer.norm_share` of the
        gradients where the reductions left them (`sources`).
        """
        arrived = [self.down.copy(unit.master.grad, source, after=self.sent[i])
                   for i, (unit, source) in enumerate(zip(self.units, self.sources))]
        norm, scale = optimizer.clip_factor(max_norm, squared_norm)
        scale = scale.cpu() if scale is not None else None
        gathers: list[Work] = []
        with torch.no_grad():
            for i, unit in enumerate(self.units):
                arrived[i].wait_host()
                if scale is not None:
                    unit.master.grad.mul_(scale)
                optimizer.step(lr, unit=i)
                self.sent[i] = self._send(unit)
                if unit.full is None:  # ZeRO-3: the next forward's gather waits for it
                    self.arrivals.expect(unit.shard, self.sent[i].wait_device)
                else:
                    self.sent[i].wait_device()
                    gathers.append(gather_full(unit))
        for work in gathers:
            work.wait()
        return float(norm)

    def _send(self, unit: UnitState) -> Landing:
        """Queue the copy of `unit`'s updated master into the weights the graph reads."""
        target = weight_shard(unit)
        source = unit.master
        if target.dtype != source.dtype:  # cast on the CPU, into the gradient's free storage
            source = unit.master.grad.view(target.dtype)[:source.numel()]
            source.copy_(unit.master)
        return self.up.copy(target, source)

    def settle(self) -> None:
        """Wait until every copy of weights to the device has landed."""
        for landing in self.sent:
            if landing is not None:
                landing.wait_host()
        self.arrivals.clear()

    @staticmethod
    def host_tensors(units: Iterable[UnitState]) -> list[torch.Tensor]:
        """The host masters of `units` and their gradients (the moments are the optimizer's)."""
        return [t for unit in units for t in (unit.master, unit.master.grad)]


def offload_masters(units: Iterable[UnitState], device: torch.device) -> HostOptimizer:
    """Move each unit's master and its gradient to the host (see the module docstring).

    Call once, before the optimizer is built over the masters. A ZeRO-3
    master is the graph's parameter: it stays on the device as `unit.shard`.
    """
    units = list(units)
    pin = device.type == "cuda"
    sources = []
    for unit in units:
        device_master = unit.master
        sources.append(device_master.grad)
        host = torch.empty(device_master.shape, dtype=torch.float32, pin_memory=pin)
        host.copy_(device_master.detach())
        host.grad = torch.zeros(host.shape, dtype=torch.float32, pin_memory=pin)
        if unit.full is None:  # ZeRO-3: the graph gathers from this shard
            unit.shard = device_master
        unit.master = host
    return HostOptimizer(units, sources, device)
