"""The Python entry points: the same operations the CLI offers.

`ptc.compile`, `ptc.run`, `ptc.estimate` and `ptc.search` are thin: each
delegates to the room that owns the work (compiler, runtime), so that a
notebook user and the `ptc` command get identical results. What the runtime
must not do itself it is handed from here: the compiler, the preflight
checks, and the built-in models (`ptc.worker.MODELS`) as its model factory.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from ptc.compiler.records.estimate import Estimate
    from ptc.compiler.records.program import Program
    from ptc.plan import Plan
    from ptc.runtime.train import RunResult

    Mesh = DeviceMesh | Mapping[str, int]


def _as_plan(plan: Plan | str | os.PathLike) -> Plan:
    if isinstance(plan, (str, os.PathLike)):
        from ptc.dsl import load_plan  # noqa: PLC0415

        return load_plan(plan)
    return plan


def compile(model: nn.Module | None, plan: Plan | str | os.PathLike | Mesh,  # noqa: A001
            *, base: Plan | str | os.PathLike | None = None) -> Program:
    """Compile `model` (any nn.Module; None: the plan's own model) under `plan` into a Program.

    `plan` is a `ptc.Plan` or the path of a `.ptc` file: its hardware,
    parallel and train sections say how the module is split and trained. Or it is a
    device mesh: a `DeviceMesh` whose dimensions are named after ptc's axes (tp, cp, dp,
    pp), or a mapping of those names to sizes such as {"dp": 2, "tp": 2}; the rest of the
    plan is `base`, or else defaults read off the model and this machine
    (`ptc.lower.mesh_plan`). Compiling needs no process group and no GPU.
    """
    from ptc.lower.driver import compile_plan  # noqa: PLC0415 - torch loads on first use

    if isinstance(plan, (str, os.PathLike)) or _is_plan(plan):
        if base is not None:
            raise TypeError("ptc.compile: base= goes with a mesh, not with a plan")
        return compile_plan(_as_plan(plan), model=model)
    from ptc.lower.mesh_plan import plan_for_mesh  # noqa: PLC0415

    return compile_plan(plan_for_mesh(model, plan, None if base is None else _as_plan(base)),
                        model=model)


def _is_plan(value: object) -> bool:
    from ptc.plan import Plan  # noqa: PLC0415

    return isinstance(value, Plan)


def run(plan: Plan | Program | str | os.PathLike, *, steps: int | None = None,
        allow_oom: bool = False) -> RunResult:
    """Train a plan (or a compiled Program) on local processes and return the losses.

    Before any process starts, what the run needs is checked (`ptc.lower.preflight`: files,
    folders, memory); `allow_oom` runs a plan predicted not to fit anyway."""
    from ptc.compiler.records.program import Program  # noqa: PLC0415
    from ptc.lower.driver import compile_plan  # noqa: PLC0415
    from ptc.lower.preflight import preflight  # noqa: PLC0415
    from ptc.runtime.train import run as _run  # noqa: PLC0415
    from ptc.worker import MODELS  # noqa: PLC0415

    return _run(plan if isinstance(plan, Program) else _as_plan(plan), models=MODELS,
                preflight=preflight, compiler=compile_plan, steps=steps, allow_oom=allow_oom)


def export(checkpoint: str | os.PathLike, *, hf: str | os.PathLike | None = None,
           torch: str | os.PathLike | None = None, model: nn.Module | None = None) -> None:
    """Write a checkpoint's trained weights as a Hugging Face directory (`hf=`) or a torch
    state dict (`torch=`) under the module's own names.

    `model`: the module that trained, when the checkpoint cannot rebuild it (one given to
    `ptc.compile` without a factory in the plan).
    """
    from ptc.models import build_model  # noqa: PLC0415
    from ptc.runtime.export import export_hf, export_torch  # noqa: PLC0415

    if (hf is None) == (torch is None):
        raise ValueError("ptc.export: give exactly one of hf= and torch=")
    if hf is not None:
        export_hf(checkpoint, hf, build=build_model, model=model)
    else:
        export_torch(checkpoint, torch, build=build_model, model=model)


def estimate(plan: Plan | str | os.PathLike) -> Estimate:
    """Predict step time, throughput, MFU and per-stage peak memory of a resolved plan."""
    from ptc.compiler.search.estimate import estimate as _estimate  # noqa: PLC0415

    return _estimate(_as_plan(plan))


def search(plan: Plan | str | os.PathLike, top: int = 5) -> list[tuple[Plan, Estimate]]:
    """The `top` fastest layouts of `plan` that fit memory, fastest first."""
    from ptc.compiler.search.plan_search import search as _search  # noqa: PLC0415

    return _search(_as_plan(plan), top=top)
