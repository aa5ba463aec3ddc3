"""The Decisions record: the plan resolved once, before the first pass.

A plan leaves choices open (the pipeline cut, "auto" checkpointing, a
predicted step time to report). `resolve` makes them once, from the plan and
the captured graph, into one frozen `Decisions` that every pass reads, the
Program carries and `ptc explain`, `ptc inspect` and the runtime read; no
one recomputes them. The cost model runs here and only here during a
compile (`estimate.balanced_cut`, once).

What is decided here, before any pass:
- the pipeline cut: how many layers each of the p·v stages holds, chosen by
  the cost model (`ptc.compiler.estimate.balanced_cut`) and pinned into
  `Decisions.plan` (first/last_stage_layers), which the pipeline_split pass
  only applies: the estimate prices the cut that compiles, and
  `estimate(decisions.plan)` is `decisions.estimate`. Unpriced, the cut is
  the plan's own pins or the even split;
- each layer's recompute policy (checkpoint = auto becomes the per-stage
  mix of none / selective / full that fits the memory budget with the least
  recompute), and the cost model's estimate and so the predicted step time.

What is decided at the seam (the pipeline split), from the graph the
whole-graph passes lowered, and added to the record there
(`with_stage_layouts`): how tensor parallelism split each parameter (the
tensor_parallel pass's layout) and each stage graph's parameter layout (its
flat units and shards), which the zero and comm_overlap passes, the Program
and the runtime read from here. Last, after the per-stage passes, each
stage's buckets and overlap decisions (`with_overlap`: the comm_overlap
pass's, which at ZeRO-3 follow the gathers the zero pass placed; one bucket
per unit where the pass did not run), so the runtime follows a decision for
every stage and never makes one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import fx

from ptc.compiler.meta import graph_info
from ptc.errors import CompileError, PtcError, UnpricedError
from ptc.compiler.recompute import LAYER_POLICIES
from ptc.plan import Plan, is_auto_checkpoint

if TYPE_CHECKING:
    from ptc.compiler.estimate import Estimate
    from ptc.compiler.overlap import OverlapPlan
    from ptc.compiler.program import ParamLayout
    from ptc.compiler.tp_layout import TensorParallelLayout

log = logging.getLogger("ptc.compiler")

POLICIES = LAYER_POLICIES
"""Recompute policies of a layer (`ptc.compiler.recompute`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Decisions:
    """The plan with every open choice made: what the passes and the runtime follow."""

    plan: Plan
    """The plan compiled: the one given, with its pipeline cut pinned where the cost model
    chose it (first/last_stage_layers; see the module docstring)."""
    checkpoint: tuple[str, ...]
    """Recompute policy of each layer of the captured graph (one of POLICIES)."""
    estimate: Estimate | None
    """The cost model's `ptc.compiler.estimate.Estimate` of the plan (None: not priced)."""
    unpriced: str | None
    """Why there is no estimate (a custom model, a plan the cost model cannot price)."""
    tensor_parallel: TensorParallelLayout | None = None
    """How tp splits each parameter (None when tp = 1): fixed at the seam."""
    layouts: Mapping[int, ParamLayout] = field(default_factory=dict)
    """Each stage graph's parameter layout, by stage index: fixed at the seam."""
    overlap: Mapping[int, OverlapPlan] = field(default_factory=dict)
    """Each stage's buckets and overlap decisions, by stage index: fixed after the per-stage
    passes."""

    def stage_layout(self, stage: int) -> ParamLayout:
        """The parameter layout of stage `stage`, fixed at the seam."""
        if stage not in self.layouts:
            raise CompileError("no parameter layout for this stage yet: per-stage passes run "
                               "after the pipeline split, where each stage's layout is fixed")
        return self.layouts[stage]

    def policy(self, layer: int | None) -> str:
        """The recompute policy of layer `layer` ("none" outside the layers)."""
        if layer is None or not 0 <= layer < len(self.checkpoint):
            return "none"
        return self.checkpoint[layer]

    @property
    def predicted_step_time(self) -> float | None:
        """Predicted seconds per optimizer step, when the plan was priced."""
        return None if self.estimate is None else float(self.estimate.step_time_s)


def resolve(gm: fx.GraphModule, plan: Plan) -> Decisions:
    """Make the plan's open choices for the captured graph `gm` (see the module docstring).

    Raises CompileError when checkpoint = auto cannot fit a stage even with
    every layer fully recomputed: compiling such a plan would only fail
    later, out of memory.
    """
    from ptc.compiler.estimate import balanced_cut  # noqa: PLC0415 - profiles the model (sympy)

    if not plan.is_resolved:
        raise CompileError("compiling needs a resolved plan: tp, pp and dp must not be auto")
    layers = graph_info(gm).num_layers
    priced, unpriced = None, None
    try:
        _check_priced_model(gm, plan)
        plan, priced = balanced_cut(plan)
    except (PtcError, ValueError) as exc:
        priced, unpriced = None, f"no predicted step time: {exc}"
        log.warning(unpriced)
    return Decisions(plan=plan, checkpoint=_policies(plan, layers, priced), estimate=priced,
                     unpriced=unpriced)


def _check_priced_model(gm: fx.GraphModule, plan: Plan) -> None:
    """UnpricedError when the module compiled (`gm`, captured from the module given to
    `ptc.compile`) is not the model the cost model priced: for a custom plan that is the
    one its factory builds, and a module of other parameters or layers would get that
    model's memory, step time and checkpoint = auto policies."""
    if plan.model.family != "custom":
        return
    from ptc.compiler.profile import plan_profile, with_model_shape  # noqa: PLC0415 - sympy

    profile = plan_profile(with_model_shape(plan))
    params = profile.params
    priced = params["pre"].total + profile.layers * params["layer"].total + params["post"].total
    compiled = sum(p.numel() for p in gm.parameters())
    layers = graph_info(gm).num_layers
    if (priced, profile.layers) != (compiled, layers):
        raise UnpricedError(
            f"the module compiled has {compiled:,} parameter elements in {layers} layers, and "
            f"the model the plan's factory \"{plan.model.factory}\" builds (the one ptc prices) "
            f"has {priced:,} in {profile.layers}: predictions of that model would not be this "
            "one's; name a factory that builds this module")


def _policies(plan: Plan, layers: int, priced: Estimate | None) -> tuple[str, ...]:
    """Each layer's recompute policy: the plan's, or checkpoint = auto's choice."""
    ckpt = plan.parallel.checkpoint
    if not is_auto_checkpoint(ckpt):
        if isinstance(ckpt, str):
            return (ckpt,) * layers
        return tuple(ckpt[i] if i < len(ckpt) else "none" for i in range(layers))
    if priced is None:
        raise CompileError(f"checkpoint = {ckpt} needs the cost model's estimate of the plan, "
                           "which failed (see the warning above); name a policy instead")
    if not priced.fits:
        from ptc.compiler.fit import nothing_fits_message  # noqa: PLC0415

        raise CompileError(nothing_fits_message(plan, list(priced.stage_memory_bytes)))
    return tuple(priced.layout.checkpoint)

