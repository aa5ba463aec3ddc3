"""Helpers of the context-parallel tests: plans of the tiny models with cp, and the worker.

Workers run inside processes started by `ptc.runtime.run_local`, which import
this module afresh: they live here, importable, not in a test file. One launch trains every case
of one process count in a row: process start-up is paid once per count.
"""

from __future__ import annotations

import dataclasses

from dist_helpers import SEQ, STEPS, tiny_plan, train_cases
from tp_helpers import tp_model

from ptc.plan import HardwareSpec, ModelSpec, ParallelSpec, Plan

ROUTER_LOSS = ModelSpec(family="custom", vocab=64, max_seq=SEQ,
                        factory="tests.user_models.transformers_models:mixtral_router_loss")
"""Mixtral trained on its next-token loss plus its load-balancing loss over the batch."""


@dataclasses.dataclass(frozen=True)
class CPCase:
    """One context-parallel layout of one tiny model."""

    family: str
    """"gpt", "llama" or "nanogpt", "+dropout" for dropout 0.1 (as `tp_helpers.tp_model`), or
    "mixtral+router_loss" (`ROUTER_LOSS`)."""
    cp: int = 2
    tp: int = 1
    sp: bool = False
    pp: int = 1
    dp: int = 1
    zero: int = 0
    dtype: str = "fp32"

    @property
    def world(self) -> int:
        """Processes the case runs on."""
        return self.cp * self.tp * self.pp * self.dp

    def __str__(self) -> str:
        parts = [self.family, f"cp{self.cp}"]
        parts += [f"tp{self.tp}"] if self.tp > 1 else []
        parts += ["sp"] if self.sp else []
        parts += [f"pp{self.pp}"] if self.pp > 1 else []
        parts += [f"dp{self.dp} zero{self.zero}"] if self.dp > 1 else []
        parts += [self.dtype] if self.dtype != "fp32" else []
        return " ".join(parts)


def cp_plan(case: CPCase, steps: int = STEPS) -> Plan:
    """The tiny model of `case`: two samples per micro-batch and dp rank, two micro-batches
    under pp (so that 1F1B has one per stage)."""
    accum = 2 if case.pp > 1 else 1
    base = tiny_plan("gpt", zero=case.zero, dp=case.dp, accum=accum, steps=steps,
                     dtype=case.dtype)
    return dataclasses.replace(
        base, model=ROUTER_LOSS if case.family == "mixtral+router_loss" else
        tp_model(case.family, case.tp),
        hardware=HardwareSpec.preset("cpu", gpus_per_node=case.world),
        parallel=ParallelSpec(cp=case.cp, tp=case.tp, pp=case.pp, dp=case.dp, zero=case.zero,
                              sequence_parallel=case.sp))


def run_cp_cases(cases: list[CPCase]) -> dict:
    """Worker: train every case (`dist_helpers.train_cases`)."""
    return train_cases(cases, cp_plan)
