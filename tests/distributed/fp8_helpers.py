"""Worker of the float8 compute tests: the tiny models trained under `train.dtype = fp8`
(emulated) and bf16, with and without tp. Importable, for the spawned processes."""

from __future__ import annotations

import dataclasses

from dist_helpers import train_cases
from tp_helpers import TPCase, tp_plan

from ptc.plan import Plan


def fp8_plan(case: tuple[str, int, str, str]) -> Plan:
    """(family, tp, dtype, fp8 scaling): the tp test's plan of the tiny model, in `dtype`
    (fp8 emulated) on one sample-pair micro-batch."""
    family, tp, dtype, scaling = case
    plan = tp_plan(TPCase(family, tp))
    return dataclasses.replace(plan, train=dataclasses.replace(
        plan.train, dtype=dtype, fp8_scaling=scaling, fp8_emulate=True))


def run_fp8_cases(cases: list[tuple[str, int, str, str]]) -> dict:
    """Worker: train every case (`dist_helpers.train_cases`)."""
    return train_cases(cases, fp8_plan)
