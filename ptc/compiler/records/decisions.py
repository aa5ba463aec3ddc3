"""The Decisions record: the plan resolved once, before the first pass.

A plan leaves choices open (the pipeline cut, "auto" checkpointing, a
predicted step time to report). `resolve` makes them once, from the plan and
the captured graph, into one frozen `Decisions` that every pass reads, the
Program carries and `ptc explain`, `ptc inspect` and the runtime read; no
one recomputes them. The cost model runs here and only here during a
compile (`estimate.balanced_cut`, once).

What is decided here, before any pass:
- the pipeline cut: how many layers each of the p·v stages holds, chosen by
  the cost model (`ptc.compiler.search.estimate.balanced_cut`) and pinned into
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

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ptc.errors import CompileError
from ptc.plan import Plan

if TYPE_CHECKING:
    from ptc.compiler.records.ep_layout import ExpertParallelLayout
    from ptc.compiler.records.estimate import Estimate
    from ptc.compiler.records.overlap import OverlapPlan
    from ptc.compiler.records.params import ParamLayout
    from ptc.compiler.records.tp_layout import TensorParallelLayout


@dataclass(frozen=True, slots=True, kw_only=True)
class Decisions:
    """The plan with every open choice made: what the passes and the runtime follow."""

    plan: Plan
    """The plan compiled: the one given, with its pipeline cut pinned where the cost model
    chose it (first/last_stage_layers; see the module docstring)."""
    checkpoint: tuple[str, ...]
    """Recompute policy of each layer of the captured graph (one of POLICIES)."""
    estimate: Estimate | None
    """The cost model's `ptc.compiler.records.estimate.Estimate` of the plan (None: not priced)."""
    unpriced: str | None
    """Why there is no estimate (a custom model, a plan the cost model cannot price)."""
    guard_folds: bool = False
    """Whether the non-finite guard rides the step's gradient all-reduce
    (`ptc.compiler.cost.step_sync.guard_folds`, priced so by the cost model)."""
    tensor_parallel: TensorParallelLayout | None = None
    """How tp splits each parameter (None when tp = 1): fixed at the seam."""
    expert_parallel: ExpertParallelLayout | None = None
    """How ep spreads the routed experts (None when ep = 1): fixed at the seam."""
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
