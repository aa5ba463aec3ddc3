"""The compile driver: capture, resolve, the pass list, and the Program.

`compile_plan(plan)` builds the plan's model on the meta device (or takes
the user's module), captures it as a (tokens, targets) -> loss graph,
resolves the plan into the Decisions record (`ptc.compiler.records.decisions`: the
cost model runs there, once), runs `PASSES` through the generic runner
(`ptc.lower.runner`) and packages the lowered stage graphs with their
layouts and reports as a `Program`. Nothing here needs a process group.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import fx, nn

from ptc.compiler.collector import collector_off
from ptc.compiler.records.decisions import Decisions
from ptc.lower.resolve import resolve
from ptc.compiler.graph.meta import graph_info, update_graph_record
from ptc.compiler.graph.position_tables import check_position_tables
from ptc.compiler.records.params import COMPUTE_DTYPES
from ptc.compiler.records.program import Program, Stage
from ptc.compiler.graph.params import param_layout
from ptc.lower.seam import with_stage_layouts
from ptc.compiler.schedule.lowering import per_rank_actions
from ptc.compiler.schedule.build import schedule_for
from ptc.compiler.graph.stage_graphs import stage_info, whole_graph_stage
from ptc.errors import CompileError
from ptc.lower.runner import DISABLE_ENV, Lowered, Pass, PassList, run_passes
from ptc.lower.stamp import (NotStampable, representative_layers, stamp_layers,
                             stamp_layers_pass)
from ptc.lower.verify import verify_graph
from ptc.passes import (cap_experts_pass, checkpoint_layers_pass, overlap_collectives_pass,
                        quantize_gemms_pass, shard_experts_pass, shard_params_pass,
                        shard_sequence_pass, shard_tensors_pass, split_context_pass,
                        split_pipeline_pass)
from ptc.plan import Plan

log = logging.getLogger(__name__)

PASSES = PassList(whole=(split_context_pass, shard_tensors_pass, shard_sequence_pass,
                         cap_experts_pass, shard_experts_pass, quantize_gemms_pass),
                  split=split_pipeline_pass,
                  per_stage=(checkpoint_layers_pass, shard_params_pass, overlap_collectives_pass))
"""The pipeline, in order: context_parallel, tensor_parallel, sequence_parallel,
expert_capacity, expert_parallel, fp8_compute |
pipeline_split | activation_checkpoint, zero, comm_overlap. fp8_compute runs after the tp
and ep splits so its GEMMs take the rank's shard and its local experts; activation_checkpoint
runs before zero so zero sees the parameters its regions read; comm_overlap runs last, on
every collective."""

PLAN_FIELDS = {
    "split_context_pass": "parallel.cp", "shard_tensors_pass": "parallel.tp",
    "shard_sequence_pass": "parallel.sequence_parallel", "shard_experts_pass": "parallel.ep",
    "cap_experts_pass": "moe.capacity_factor",
    "quantize_gemms_pass": "train.dtype",
    "split_pipeline_pass": "parallel.pp", "checkpoint_layers_pass": "parallel.checkpoint",
    "shard_params_pass": "parallel.zero", "overlap_collectives_pass": "parallel.overlap",
}
"""The plan field that asks for each pass: where a check before the run points at its error."""

NEEDED_BY = {
    "split_context_pass": lambda plan: plan.parallel.cp > 1 and "cp > 1",
    "shard_tensors_pass": lambda plan: plan.parallel.tp > 1 and "tp > 1",
    "shard_sequence_pass": lambda plan: (plan.parallel.sequence_parallel and plan.parallel.tp > 1
                                         and "sequence_parallel"),
    "shard_experts_pass": lambda plan: plan.parallel.ep > 1 and "ep > 1",
    "cap_experts_pass": lambda plan: (plan.moe.capacity_factor is not None
                                      and "moe.capacity_factor"),
    "split_pipeline_pass": lambda plan: plan.parallel.pp > 1 and "pp > 1",
    "shard_params_pass": lambda plan: plan.parallel.zero == 3 and "zero = 3",
    "quantize_gemms_pass": lambda plan: plan.train.dtype == "fp8" and "dtype = fp8",
}
"""Passes without which the runtime would train something other than the plan, and when."""


@collector_off()
def capture_plan(plan: Plan, model: nn.Module | None = None, *,
                 layers: int | None = None) -> fx.GraphModule:
    """Capture the plan's model (or `model`) on meta at the plan's micro-batch shape and dtype.

    `layers`: the plan's own model built at that depth instead (a stamped compile's
    representative, `compile_plan`).
    """
    from ptc.compiler.capture import capture  # noqa: PLC0415 - capture needs the model zoo
    from ptc.models import build_model  # noqa: PLC0415

    dtype = COMPUTE_DTYPES[plan.train.compute_dtype]
    if model is None:  # ours to change: in the compute dtype already, capture copies nothing
        spec = plan.model if layers is None else dataclasses.replace(plan.model, layers=layers)
        model = build_model(spec, device="meta").to(dtype)
    return capture(model, micro_batch=plan.train.micro_batch, seq_len=plan.train.seq_len,
                   dtype=dtype)


@collector_off()
def compile_plan(plan: Plan, *, model: nn.Module | None = None,
                 on_capture: Callable[[fx.GraphModule], object] | None = None) -> Program:
    """Compile a plan: capture its model (or `model`) on meta, run the passes, build the Program.

    A built-in model deep enough is captured and lowered at a few layers and
    stamped out to its depth after the whole-graph passes (`ptc.lower.stamp`):
    the same Program, at about the cost of a shallow one. Where the graph
    cannot be stamped the model is compiled at full depth. `on_capture` is
    shown the captured graph, at full depth, before it is lowered (`ptc
    compile` summarises it).
    """
    shown = on_capture is None
    layers = representative_layers(plan) if model is None else None
    if layers is not None:
        representative = capture_plan(plan, layers=layers)
        try:
            captured = stamp_layers(representative, plan.model.layers, plan)
            if not shown:
                on_capture(captured)
                shown = True
            return compile_graph(captured, plan, representative=representative)
        except NotStampable as why:
            log.debug("compiling at full depth: %s", why)
        except CompileError as exc:
            if not isinstance(exc.__cause__, NotStampable):
                raise
            log.debug("compiling at full depth: %s", exc.__cause__)
    captured = capture_plan(plan, model)
    if not shown:
        on_capture(captured)
    return compile_graph(captured, plan, model=model)


@collector_off()
def compile_graph(gm: fx.GraphModule, plan: Plan, *, passes: PassList = PASSES,
                  knobs: Mapping[str, Mapping[str, Any]] | None = None,
                  disabled: Sequence[str] = (), model: nn.Module | None = None,
                  representative: fx.GraphModule | None = None) -> Program:
    """Lower an already captured (tokens, targets) -> loss graph into a Program.

    `model`: the user's module `gm` was captured from (None: the plan's own model).
    `representative`: the same model captured at a few layers, `gm` its stamped copy
    (`compile_plan`): the whole-graph passes run on it, then it is stamped out.
    """
    captured = graph_info(gm).vocab  # a padded table (nanoGPT's 50304) may be wider
    if None not in (plan.model.vocab, captured) and plan.model.vocab > captured:
        raise CompileError(f"model.vocab = {plan.model.vocab}, but {graph_info(gm).model_class}'s "
                           f"logits have only {captured} columns: ids up to "
                           f"{plan.model.vocab - 1} would fall outside its vocabulary")
    check_position_tables(gm, plan.train.seq_len)
    # Split into stages, the model's parameters live in several graphs: lay them out whole first.
    whole = param_layout(gm, plan.grad_ranks) if plan.parallel.pp > 1 else None
    decisions, lowered = lower_graph(gm, plan, passes, knobs=knobs, disabled=disabled,
                                     representative=representative)
    stages = tuple(Stage(index=i, info=stage_info(graph), graph=graph,
                         layout=decisions.layouts[i], overlap=decisions.overlap[i])
                   for i, graph in enumerate(lowered.stages))
    schedule = schedule_for(plan)
    return Program(plan=plan, decisions=decisions, stages=stages,
                   layout=whole if whole is not None else stages[0].layout,
                   pass_log=lowered.log, schedule=schedule, actions=per_rank_actions(schedule),
                   model=model)


def lower_graph(gm: fx.GraphModule, plan: Plan, passes: PassList = PASSES, *,
                knobs: Mapping[str, Mapping[str, Any]] | None = None,
                disabled: Sequence[str] = (),
                representative: fx.GraphModule | None = None) -> tuple[Decisions, Lowered]:
    """Resolve `plan` for the captured graph `gm` and run `passes` on it: the Decisions as the
    runner completed them, and its result; with a `representative` of it, the whole-graph
    passes run on that, stamped out after."""
    decisions = resolve(gm, plan)
    try:
        if representative is not None:
            lowered = run_passes(representative, decisions, passes, knobs=knobs,
                                 disabled=_allowed_to_disable(plan, disabled),
                                 deepen=stamp_layers_pass)
        else:
            lowered = run_passes(gm, decisions, passes, knobs=knobs,
                                 disabled=_allowed_to_disable(plan, disabled))
        return lowered.decisions, lowered
    except CompileError as exc:
        exc.field = exc.field or PLAN_FIELDS.get(exc.pass_name)
        raise


def pass_list(*passes: Pass) -> PassList:
    """`passes` in their places around the seam, as PASSES places them (others run per stage).

    For running part of the pipeline, in tests and when debugging a pass.
    """
    return PassList(whole=tuple(fn for fn in passes if fn in PASSES.whole),
                    split=next((fn for fn in passes if fn is PASSES.split), None),
                    per_stage=tuple(fn for fn in passes
                                    if fn not in PASSES.whole and fn is not PASSES.split))


def _allowed_to_disable(plan: Plan, disabled: Sequence[str]) -> Sequence[str]:
    """`disabled`, unless it (or PTC_DISABLE_PASSES) names a pass the plan cannot do without."""
    names = [*disabled, *(n.strip() for n in os.environ.get(DISABLE_ENV, "").split(","))]
    for name in names:
        why = NEEDED_BY.get(name, lambda plan: False)(plan)
        if why:
            raise CompileError(f"{DISABLE_ENV}: {name} cannot be skipped: the plan's {why} needs "
                               "it, and without it the runtime would train another model")
    return disabled


def apply_pass(fn: Pass, gm: fx.GraphModule, plan: Plan, **knobs: Any) -> fx.GraphModule:
    """Run one pass of `PASSES` on `gm` as the runner would, then the verifier (tests, notebooks).

    The plan is resolved for `gm`; a per-stage pass given a graph that was
    never split runs on it as the only stage, its layout fixed first as at the seam.
    """
    decisions = resolve(gm, plan)
    if fn in PASSES.per_stage:
        if stage_info(gm) is None:
            update_graph_record(gm, stage=whole_graph_stage(gm))
        decisions = with_stage_layouts(decisions, gm, [gm])
    out = fn(gm, decisions, **knobs)
    verify_graph(out, plan, after=fn.__name__)
    return out
