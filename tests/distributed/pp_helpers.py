"""Helpers of the pipeline-parallel tests: plans of the tiny models with pp, and the worker.

Workers run inside processes started by `ptc.runtime.run_local`, which import
this module afresh: they live here, importable, not in a test file. One launch trains every case
of one process count in a row: process start-up is paid once per count.
"""

from __future__ import annotations

import dataclasses

from dist_helpers import STEPS, tiny_plan, train_cases

from ptc.plan import HardwareSpec, ParallelSpec, Plan


@dataclasses.dataclass(frozen=True)
class Case:
    """One pipeline layout of one tiny model."""

    family: str
    pp: int
    schedule: str
    microbatches: int
    virtual: int = 1
    dp: int = 1
    zero: int = 0
    layers: int = 4
    tp: int = 1
    sp: bool = False
    ends: int | None = None
    """first_stage_layers = last_stage_layers, when the split is uneven."""
    dropout: float = 0.0
    checkpoint: str = "none"
    dtype: str = "fp32"

    @property
    def world(self) -> int:
        """Processes the case runs on."""
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        v = f" v{self.virtual}" if self.virtual > 1 else ""
        dp = f" dp{self.dp} zero{self.zero}" if self.dp > 1 else ""
        tp = f"tp{self.tp}{' sp' if self.sp else ''} " if self.tp > 1 else ""
        ends = f" L{self.layers} ends {self.ends}" if self.ends is not None else ""
        drop = f" dropout {self.dropout}" if self.dropout else ""
        more = "".join(f" {x}" for x in (self.checkpoint, self.dtype) if x not in ("none", "fp32"))
        return (f"{tp}{self.family} pp{self.pp} {self.schedule}{v} m{self.microbatches}{dp}"
                f"{ends}{drop}{more}")


def pp_plan(case: Case, steps: int = STEPS) -> Plan:
    """The tiny model of `case` with `layers` layers, one sample per micro-batch."""
    base = tiny_plan(case.family, zero=case.zero, dp=case.dp, accum=case.microbatches,
                     steps=steps, dtype=case.dtype)
    return dataclasses.replace(
        base, model=dataclasses.replace(base.model, layers=case.layers, dropout=case.dropout),
        hardware=HardwareSpec.preset("cpu", gpus_per_node=case.world),
        parallel=ParallelSpec(tp=case.tp, pp=case.pp, dp=case.dp, zero=case.zero,
                              sequence_parallel=case.sp, schedule=case.schedule,
                              virtual_stages=case.virtual, first_stage_layers=case.ends,
                              last_stage_layers=case.ends, checkpoint=case.checkpoint))


def run_pp_cases(cases: list[Case]) -> dict:
    """Worker: train every case (`train_cases`); rank 0's results also hold "peaks", every
    rank's (pipeline rank, peak in-flight micro-batches), and "regathered", every rank's
    (pipeline rank, most bytes of ZeRO-3 weights held re-gathered between an I and its W)."""
    import torch.distributed as dist

    regathered = _count_regathered()

    def peak(trainer, program, groups) -> tuple[int, int, int]:
        most = regathered.pop()
        return dist.get_rank(groups["pp"]), trainer.peak_in_flight, most

    results = train_cases(cases, pp_plan, gathered=peak)
    for got in results.values():
        every = got.pop("gathered")
        got["peaks"] = [(rank, in_flight) for rank, in_flight, _ in every]
        got["regathered"] = [(rank, most) for rank, _, most in every]
    return results


class _Most:
    """The largest value seen since the last `pop`."""

    def __init__(self):
        self.value = 0

    def see(self, value: int) -> None:
        self.value = max(self.value, value)

    def pop(self) -> int:
        value, self.value = self.value, 0
        return value


def _count_regathered() -> _Most:
    """Watch ZeRO-3 under a split backward in this process: after each I, the bytes of
    weights every micro-batch's session holds re-gathered (`ParamSession._full`), all
    sessions together (no backward runs then: what is held waits for a W)."""
    import weakref

    from ptc.ops.zero3 import ParamSession
    from ptc.runtime import executor

    sessions, most = weakref.WeakSet(), _Most()
    start, input_backward = ParamSession.__init__, executor.input_backward

    def init(self, *args, **kwargs):
        start(self, *args, **kwargs)
        sessions.add(self)

    def watched(*args, **kwargs):
        got = input_backward(*args, **kwargs)
        most.see(sum(t.numel() * t.element_size() for session in sessions
                     for buffers in session._full.values() for t in buffers))
        return got

    ParamSession.__init__, executor.input_backward = init, watched
    return most
