"""Run health: the non-finite guard, and reports that name a hung or straggling rank.

Non-finite guard. After backward each rank checks its loss and gradient
buffers; one all-reduce over every rank of the job of a one-slot-per-rank
vector tells all of them which ranks saw a NaN or an Inf, so every rank takes
the same decision (stop, skip, roll back) before any optimizer step. The same
all-reduce carries two more slots, the sum of the ranks' step losses and of
their parts of the squared gradient norm, so neither the step's loss nor the
clipping norm costs a collective of its own. A rank
deciding alone would skip a collective the others enter, and the job would
hang. Weights are checked the same way before a checkpoint is written.

A job that is pure data parallel at ZeRO-0 (`FoldedGuard`) needs not even
that all-reduce: the same slots ride the step's last gradient all-reduce,
and the summed gradients, the same on every rank, are checked where they
lie — the decision is again the same everywhere, and so is the clipping
norm each rank takes of them.

Hangs and stragglers. Every process group has a finite timeout
(`ptc.runtime.mesh.timeout`). Under NCCL the flight recorder keeps each
rank's last collectives and dumps them when a timeout fires
(`configure_flight_recorder`); `python -m torch.distributed.flight_recorder.fr_trace
DIR` reads the dumps and names the rank that never joined. Under gloo the
waiting ranks get a timeout error; `diagnose_timeout` then runs torch's
`monitored_barrier` on a spare gloo group: rank 0 learns which ranks do not
answer (hung) — or that all do (a straggler that arrived late).
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from ptc.runtime.faults import corrupt_gradients

TRACE_BUFFER_ENTRIES = 2000
"""Collectives the NCCL flight recorder remembers per rank (its ring buffer)."""


def nonfinite_ranks(tensors: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None,
                    *, device: torch.device | None = None) -> tuple[int, ...]:
    """The ranks (of `group`, default all) where any of their `tensors` holds a NaN or Inf.

    Collective over `group`, run on `device` (default: the first tensor's; the
    rank's device when the tensors are in host memory, as offloaded masters
    are); every rank gets the same answer. A tensor is
    checked through its sum, which is non-finite when an element is (or
    when finite elements overflow fp32: as unusable). It avoids a
    full-size boolean temporary per gradient buffer.
    """
    tensors = list(tensors)
    share = torch.zeros((), device=device if device is not None else tensors[0].device)
    return nonfinite_ranks_and_sum(tensors, share, group)[0]


def nonfinite_ranks_and_sum(tensors: Sequence[torch.Tensor], share: torch.Tensor,
                            group: dist.ProcessGroup | None = None
                            ) -> tuple[tuple[int, ...], torch.Tensor]:
    """`nonfinite_ranks(tensors)`, and the sum over the ranks of their `share` (a scalar, or
    a vector of shares summed slot by slot).

    One all-reduce carries both (a slot per rank for its flag, the shares'
    after them): the step loss and the gradient norm travel with the guard
    instead of in collectives of their own.
    """
    shares = share.detach().float().reshape(-1)
    sums = torch.stack([t.detach().sum(dtype=torch.float32).to(share.device) for t in tensors])
    bad = (~torch.isfinite(sums).all()).to(torch.float32)
    if not dist.is_initialized():
        return ((0,) if bad.item() else ()), shares.reshape(share.shape)
    world = dist.get_world_size(group)
    flags = torch.zeros(world + shares.numel(), device=share.device)
    flags[dist.get_rank(group)] = bad
    flags[world:] = shares
    dist.all_reduce(flags, group=group)
    return tuple(flags[:world].nonzero().flatten().tolist()), flags[world:].reshape(share.shape)


class FoldedGuard:
    """The non-finite guard carried by the step's last gradient all-reduce: no collective of
    its own.

    For a job that is pure data parallel at ZeRO-0: gradients all-reduced
    over a group that is every rank of the job (no tp, pp, cp, no optimizer
    offload), in fp32 buffers and fp32 reductions, so the loss rides them
    unrounded. Per step: `start`; the gradient reducer hands `see` each
    bucket's buffers just before their all-reduce (this rank's own sums),
    and appends `slots()` to the step's last all-reduce — two slots per
    rank: 1 where that rank's loss or own gradients are non-finite, and its
    loss (the others add zeros to it, so the job's loss sum is taken in
    rank order, whatever order the collective adds in). After the
    reductions every rank holds the same slots and the same summed
    gradients, so `verdict` decides alike everywhere without a collective:
    the bad ranks are those whose flag is set; or, when only the summed
    gradients are non-finite (finite parts that overflow), every rank, as
    each sees them. A check goes through a tensor's sum, as
    `nonfinite_ranks`'.
    """

    def __init__(self, rank: int, world: int, device: torch.device):
        self.rank, self.world, self.device = rank, world, device
        self._loss: torch.Tensor | None = None
        self._sums: list[torch.Tensor] = []
        self._slots: torch.Tensor | None = None

    def start(self, step: int, loss: torch.Tensor, grads: Sequence[torch.Tensor]) -> None:
        """Begin step `step` (0-based): `loss` is the tensor the rank's step loss is summed
        into in place, `grads` its gradient buffers, which the step accumulates into and
        then reduces. The `PTC_FAULT` nan hook (`faults`) fires here, into the rank's own
        gradient before any reduction, where this rank's slot catches it."""
        self._loss, self._sums, self._slots = loss, [], None
        corrupt_gradients(self.rank, step + 1, grads)  # test hook

    def see(self, flats: Sequence[torch.Tensor]) -> None:
        """Note this rank's own sums of gradient buffers about to be all-reduced."""
        self._sums.extend(f.sum(dtype=torch.float32) for f in flats)

    def slots(self) -> torch.Tensor:
        """The slots this rank adds to the step's last gradient all-reduce (after every
        `see` of the step); the reduction sums them in place."""
        loss = self._loss.detach().float()
        slots = torch.zeros(2 * self.world, device=self.device)
        slots[self.rank] = (~torch.isfinite(torch.stack([loss, *self._sums])).all()).float()
        slots[self.world + self.rank] = loss
        self._slots = slots
        return slots

    def verdict(self, grads: Sequence[torch.Tensor]) -> tuple[tuple[int, ...], torch.Tensor]:
        """(the ranks that saw a NaN or Inf, the job's loss sum), the same on every rank;
        `grads`: the summed gradient buffers, once every reduction of the step is done."""
        if self._slots is None:
            raise RuntimeError("the step's gradient all-reduce did not carry the guard's slots")
        slots, self._slots = self._slots, None
        flagged = slots[:self.world] != 0
        summed = torch.stack([g.sum(dtype=torch.float32) for g in grads])
        seen = torch.where(flagged.any(), flagged, ~torch.isfinite(summed).all())
        return tuple(seen.nonzero().flatten().tolist()), slots[self.world:].sum()


def guarded_update(rank: int, step: int, loss: torch.Tensor, share: torch.Tensor,
                   grads: Sequence[torch.Tensor], norm_share: Callable[[], torch.Tensor],
                   update: Callable[[torch.Tensor], float], folded: FoldedGuard | None = None
                   ) -> tuple[tuple[int, ...], float, torch.Tensor]:
    """The non-finite guard of one optimizer step: run `update` unless a rank saw NaN or Inf.

    Call after backward and the gradient reductions, with this rank's step
    `loss`, its `share` of the job's loss sum (its loss, or zero where
    another rank reports the same one) and its `grads`, on every rank of the
    job (collective: one all-reduce, `nonfinite_ranks_and_sum`; none when
    `folded`, the `FoldedGuard` the step's gradient all-reduce carried).
    `norm_share()` gives this rank's part of the squared gradient norm
    (`ShardedOptimizer.norm_share`), which the same all-reduce sums (when
    `folded`: the whole square, every rank holding every summed gradient);
    `update(squared_norm)` clips, steps and publishes and returns the gradient
    norm; it runs on every rank or on none. Returns the bad ranks (empty: the
    update ran), the norm (NaN when skipped) and the summed loss. `step` is
    0-based; the `PTC_FAULT` nan hook (`faults`) fires here (when `folded`:
    in its `start`).
    """
    if folded is not None:  # every rank holds the whole summed gradients: its part is all
        bad, total = folded.verdict(grads)
        squared = norm_share()
    else:
        corrupt_gradients(rank, step + 1, grads)  # test hook
        bad, sums = nonfinite_ranks_and_sum([loss, *grads],
                                            torch.stack([share.detach().float(),
                                                         norm_share().float()]))
        total, squared = sums[0], sums[1]
    return bad, (float("nan") if bad else update(squared)), total


def configure_flight_recorder(trace_dir: str | os.PathLike) -> None:
    """Ask NCCL to record collectives and dump them on a timeout into `trace_dir`.

    Sets defaults only (the user's environment wins); must run before the
    process group is created. Gloo ignores these variables.
    """
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(TRACE_BUFFER_ENTRIES))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
                          str(Path(trace_dir) / "nccl_trace_rank_"))


def is_timeout(exc: BaseException) -> bool:
    """Whether `exc` (or its cause) is a collective that gave up waiting."""
    while exc is not None:
        text = f"{type(exc).__name__} {exc}".lower()
        if "timed out" in text or "timeout" in text:  # gloo: "Timed out"; NCCL: "timeout"
            return True
        exc = exc.__cause__
    return False


def diagnose_timeout(group: dist.ProcessGroup, timeout: datetime.timedelta) -> str:
    """After a timeout: which ranks of `group` (a gloo group) do not answer, as a sentence.

    Collective for the ranks that still run; rank 0 learns the names, the
    others are told to read rank 0's report.
    """
    try:
        dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as exc:
        ranks = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(exc))
        if ranks and dist.get_rank() == 0:
            names = ", ".join(r.strip() for r in ranks.group(1).split(","))
            return f"rank(s) {names} did not answer a monitored barrier: hung or dead"
        return "rank 0 names the ranks that did not answer (see its report)"
    return "every rank answered a monitored barrier afterwards: a straggler, not a hang"
