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
    rank's (pipeline rank, peak in-flight micro-batches), "regathered" and "rebuilt", every
    rank's (pipeline rank, most bytes held between an I and its W at once: of ZeRO-3
    weights re-gathered, of recomputed activations)."""
    import torch.distributed as dist

    regathered, rebuilt = _count_held_until_w()

    def peak(trainer, program, groups) -> tuple[int, int, int, int]:
        return (dist.get_rank(groups["pp"]), trainer.peak_in_flight, regathered.pop(),
                rebuilt.pop())

    results = train_cases(cases, pp_plan, gathered=peak)
    for got in results.values():
        every = got.pop("gathered")
        got["peaks"] = [(rank, in_flight) for rank, in_flight, _, _ in every]
        got["regathered"] = [(rank, most) for rank, _, most, _ in every]
        got["rebuilt"] = [(rank, most) for rank, _, _, most in every]
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


def _count_held_until_w() -> tuple[_Most, _Most]:
    """Watch a split backward in this process: after each I (no backward runs then: what is
    held waits for a W), the bytes every micro-batch's ZeRO-3 session holds re-gathered
    (`ParamSession._full`), and the distinct activation storages the recomputed regions
    keep (`_Recomputed.saved`, weights left out), all micro-batches together."""
    import weakref

    from ptc.ops import recompute
    from ptc.ops.zero3 import ParamSession
    from ptc.runtime import executor

    sessions, regions = weakref.WeakSet(), weakref.WeakSet()
    regathered, rebuilt = _Most(), _Most()
    weights: set[int] = set()
    start_session, start_region = ParamSession.__init__, recompute._Recomputed.__init__
    start_trainer, input_backward = executor.Trainer.__init__, executor.input_backward

    def session(self, *args, **kwargs):
        start_session(self, *args, **kwargs)
        sessions.add(self)

    def region(self, *args, **kwargs):
        start_region(self, *args, **kwargs)
        regions.add(self)

    def trainer(self, *args, **kwargs):
        start_trainer(self, *args, **kwargs)
        weights.clear()
        weights.update(w.untyped_storage().data_ptr() for chunk in self.chunks.values()
                       for w in chunk.gm.parameters())

    def watched(*args, **kwargs):
        got = input_backward(*args, **kwargs)
        regathered.see(sum(t.numel() * t.element_size() for s in sessions
                           for buffers in s._full.values() for t in buffers))
        kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for r in regions for t in (r.saved or ()) if t is not None}
        rebuilt.see(sum(n for ptr, n in kept.items() if ptr not in weights))
        return got

    ParamSession.__init__, recompute._Recomputed.__init__ = session, region
    executor.Trainer.__init__, executor.input_backward = trainer, watched
    return regathered, rebuilt
