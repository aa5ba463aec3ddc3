"""Optimizer offload (`parallel.offload = optimizer`): masters, moments and the step on the host.

Terms: the *device* is where the rank's graphs run and its gradients are
reduced (a GPU, or the CPU in tests); the *host* is CPU memory, pinned when
the device is a GPU so that copies run asynchronously at the link's rate.

`offload_masters` moves what the optimizer updates off the device: each
unit's `master` (ptc.runtime.params) becomes an fp32 host tensor, with an
fp32 host gradient as its `.grad`, so torch's AdamW creates its moments
beside it and steps on the CPU. The device keeps what the graph needs:
its weights (ZeRO 1-2: the unit's full buffer; ZeRO-3: the fp32 shard the
graph gathers, then held in `UnitState.shard`) and the gradient
accumulators the reductions fill. With 16-bit weights at ZeRO 1-2 the
device's fp32 master copy is freed; the optimizer's moments never reach it.

An update then runs:

1. `HostOptimizer.pull`: the reduced fp32 gradient of the part this rank
   updates goes to the host — every unit's copy queued at once (non-blocking
   into pinned memory), one wait before the CPU reads them;
2. the clip and the step (`ShardedOptimizer`, unchanged) on the host
   tensors; the norm's partial sum travels to the device for its collectives;
3. `ptc.runtime.params.publish` copies each updated master into what the
   graph reads, casting to the compute dtype — into the rank's shard of the
   full buffer before the all-gather (ZeRO 1-2), or into the graph's shard
   (ZeRO-3). Non-blocking from pinned memory: the copy is queued on the
   device's stream ahead of the all-gather and the next forward, and the
   Python thread goes on. The host master is next written by the following
   update, after that update's `pull` has waited for the device.

The arithmetic is the non-offloaded run's: the same fp32 gradients, norm,
clip factor and AdamW on the same fp32 values. On a CPU device it is the
same computation bit for bit; on a GPU the CPU's Adam kernel rounds as
torch's CPU kernels do, which may differ from its CUDA kernels in the last
bit.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ptc.runtime.params import UnitState


class HostOptimizer:
    """The device gradients an offloaded optimizer reads, and the host tensors it owns."""

    def __init__(self, units: list[UnitState], sources: list[torch.Tensor],
                 device: torch.device):
        """`units` whose masters are on the host; `sources[i]` the device fp32 gradient of
        what unit i's master updates (made by `offload_masters`)."""
        self.units, self.sources, self.device = units, sources, device

    def pull(self) -> None:
        """Copy every unit's reduced gradient into its host master's `.grad`; call after the
        step's reductions, before the clip."""
        cuda = self.device.type == "cuda"
        with torch.no_grad():
            for unit, source in zip(self.units, self.sources):
                unit.master.grad.copy_(source, non_blocking=cuda)
        if cuda:  # the CPU reads them next
            torch.cuda.synchronize(self.device)

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
