"""The compile pipeline: capture, the ordered pass list, and the Program.

`compile_plan(plan)` builds the plan's model on the meta device, captures it
as a (tokens, targets) -> loss graph, runs the pass list of `ptc.passes`
through `run_passes`, and packages the lowered graph with its parameter
layout and reports as a `Program`. Nothing here needs a process group.

`run_passes` is the generic runner (DESIGN convention 2): each pass is
`fn(gm, plan, *, knobs) -> gm`; a pass that raises is reported by name with
the passes that ran before it; what a pass logs on the "ptc.passes" logger
becomes the Program's pass log; with `PTC_DUMP_DIR` set, the graph is
written after capture and after each pass (`00_captured.txt`,
`01_shard_params_pass.txt`, ...) as readable code and as a node list.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import fx, nn

from ptc.compiler.overlap import OVERLAP_KEY
from ptc.compiler.program import (COMPUTE_DTYPES, ParamLayout, Program, Stage, ZeroShards,
                                  param_layout)
from ptc.compiler.schedule import schedule_for
from ptc.compiler.stages import pipeline_stages, tied_names
from ptc.compiler.tp_layout import TP_KEY
from ptc.errors import CompileError, PtcError
from ptc.plan import Plan

Pass = Callable[..., fx.GraphModule]
PASS_LOGGER = "ptc.passes"


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_passes(gm: fx.GraphModule, plan: Plan, passes: Sequence[Pass], *,
               knobs: Mapping[str, Mapping[str, Any]] | None = None,
               dump_dir: str | os.PathLike | None = None) -> tuple[fx.GraphModule, list[str]]:
    """Run `passes` in order on `gm`; return the lowered graph and the pass log.

    `knobs` maps a pass's function name to its keyword knobs. A failing pass
    raises CompileError naming it and the passes before it, so a bug is
    traced to the pass that made it, not the one that tripped over it.
    """
    dump_dir = dump_dir or os.environ.get("PTC_DUMP_DIR")
    _dump(dump_dir, 0, "captured", gm)
    logger = logging.getLogger(PASS_LOGGER)
    log: list[str] = []
    done: list[str] = []
    for index, fn in enumerate(passes, start=1):
        name = fn.__name__
        handler, level = _Collect(), logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            gm = _apply(fn, gm, plan, dict((knobs or {}).get(name, {})))
        except Exception as exc:
            after = ", ".join(done) if done else "capture only"
            raise CompileError(f"pass {name} failed (passes run before it: {after}): "
                               f"{type(exc).__name__}: {exc}") from exc
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        log.extend(f"{name}: {message}" for message in handler.messages)
        done.append(name)
        _dump(dump_dir, index, name, gm)
    return gm, log


def _apply(fn: Pass, gm: fx.GraphModule, plan: Plan, knobs: dict[str, Any]) -> fx.GraphModule:
    """Run one pass on `gm`, or, once the graph is split into pipeline stages, on every stage."""
    stages = pipeline_stages(gm)
    if not stages:
        return fn(gm, plan, knobs=knobs)
    for name, stage in stages:
        setattr(gm, name, fn(stage, plan, knobs=knobs))
    return gm


def _dump(dump_dir: str | os.PathLike | None, index: int, name: str, gm: fx.GraphModule) -> None:
    if not dump_dir:
        return
    path = Path(dump_dir)
    path.mkdir(parents=True, exist_ok=True)
    text = gm.print_readable(print_output=False) + "\n\n# nodes\n" + str(gm.graph) + "\n"
    (path / f"{index:02d}_{name}.txt").write_text(text)


def compile_graph(gm: fx.GraphModule, plan: Plan, *, passes: Sequence[Pass] | None = None,
                  knobs: Mapping[str, Mapping[str, Any]] | None = None) -> Program:
    """Lower an already captured (tokens, targets) -> loss graph into a Program."""
    if not plan.is_resolved:
        raise CompileError("compiling needs a resolved plan: tp, pp and dp must not be auto")
    if passes is None:
        from ptc.passes import PASSES  # noqa: PLC0415 - passes import the compiler

        passes = PASSES
    # Split into stages, the model's parameters live in several graphs: lay them out whole first.
    whole = param_layout(gm, plan.parallel.dp) if plan.parallel.pp > 1 else None
    gm, log = run_passes(gm, plan, passes, knobs=knobs)
    split = pipeline_stages(gm)
    if split:
        stages = tuple(Stage(index=i, graph=stage, layout=_layout(stage, plan),
                             overlap=stage.meta.get(OVERLAP_KEY))
                       for i, (_, stage) in enumerate(split))
    else:
        stages = (Stage(index=0, graph=gm, overlap=gm.meta.get(OVERLAP_KEY)),)
        whole = _layout(gm, plan)
    return Program(plan=plan, stages=stages, layout=whole, pass_log=tuple(log),
                   predicted_step_time=predicted_step_time(plan), schedule=schedule_for(plan),
                   tensor_parallel=gm.meta.get(TP_KEY))


def _layout(gm: fx.GraphModule, plan: Plan) -> ParamLayout:
    """The parameter layout of a lowered graph: the zero pass's, or one by first use."""
    shards = getattr(gm, "zero", None)
    if isinstance(shards, ZeroShards):
        return shards.layout
    return param_layout(gm, plan.parallel.dp, own_units=tied_names(gm))


def capture_plan(plan: Plan, model: nn.Module | None = None) -> fx.GraphModule:
    """Capture the plan's model (or `model`) on meta at the plan's micro-batch shape and dtype."""
    from ptc.compiler.capture import capture  # noqa: PLC0415 - capture needs the model zoo
    from ptc.models import build_model  # noqa: PLC0415

    if model is None:
        model = build_model(plan.model, device="meta")
    return capture(model, micro_batch=plan.train.micro_batch, seq_len=plan.train.seq_len,
                   dtype=COMPUTE_DTYPES[plan.train.dtype])


def compile_plan(plan: Plan, *, model: nn.Module | None = None) -> Program:
    """Compile a plan: capture its model (or `model`) on meta, run the passes, build the Program."""
    return compile_graph(capture_plan(plan, model), plan)


def predicted_step_time(plan: Plan) -> float | None:
    """The cost model's predicted step time in seconds (`ptc.compiler.estimate`), if it has one.

    The one hook between the cost model and the runtime's step report. A
    plan the cost model cannot price still compiles and trains: the reason
    is logged and the prediction is None.
    """
    from ptc.compiler.estimate import estimate  # noqa: PLC0415 - profiles the model (slow once)

    if plan.model.family == "custom":  # profiles are built from a family's shape fields
        logging.getLogger("ptc.compiler").info("no predicted step time for a custom model")
        return None
    try:
        return float(estimate(plan).step_time_s)
    except (PtcError, ValueError) as exc:
        logging.getLogger("ptc.compiler").warning("no predicted step time: %s", exc)
        return None
