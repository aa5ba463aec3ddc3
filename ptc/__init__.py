"""ptc: a declarative compiler for parallel training plans.

A plan (a `.ptc` file or a `ptc.Plan` built in Python) says the model, the
hardware and the parallel axes; ptc captures the model with torch.fx, lowers
it into per-rank programs, predicts memory and step time, and runs it.

Importing `ptc` is cheap: torch-heavy parts load on first use, so that
`ptc check` answers quickly.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from ptc.errors import CaptureError, CompileError, PlanError, PtcError
from ptc.plan import (
    DataSpec,
    HardwareSpec,
    InitSpec,
    LinkSpec,
    LRScheduleSpec,
    ModelSpec,
    OptimizerSpec,
    ParallelSpec,
    Plan,
    RuntimeSpec,
    ShardRule,
    TrainSpec,
)

__version__ = "0.1.0"

_LAZY = {
    "load_plan": ("ptc.dsl", "load_plan"),
    "parse_plan": ("ptc.dsl", "parse"),
    "compile": ("ptc.api", "compile"),
    "run": ("ptc.api", "run"),
    "estimate": ("ptc.api", "estimate"),
    "search": ("ptc.api", "search"),
    "export": ("ptc.api", "export"),
}

__all__ = [
    "CaptureError", "CompileError", "DataSpec", "HardwareSpec", "InitSpec", "LRScheduleSpec",
    "LinkSpec", "ModelSpec", "OptimizerSpec", "ParallelSpec", "Plan", "PlanError", "PtcError",
    "RuntimeSpec", "ShardRule", "TrainSpec", *_LAZY,
]


def _hand_down_the_models() -> None:
    """Give the compiler's profiles the model zoo's builder (`ptc.compiler.profile.models`):
    the compiler never imports `ptc.models`. Both load only when a profile is made."""
    from ptc.compiler.profile.models import ModelSource, use_models  # noqa: PLC0415

    def build(spec: ModelSpec, device: str):
        return import_module("ptc.models").build_model(spec, device=device)

    def factory(name: str):
        return import_module("ptc.models.build").resolve_factory(name)

    use_models(ModelSource(build=build, factory=factory))


_hand_down_the_models()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ptc' has no attribute {name!r}")
