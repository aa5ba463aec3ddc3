"""What the driver adds to the Decisions at the seam of the pass list (the pipeline split)
and after the per-stage passes: the tp layout and each stage's parameter layout, then each
stage's overlap plan (`ptc.compiler.records.decisions`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import fx

from ptc.compiler.graph.meta import graph_record
from ptc.compiler.graph.params import stage_param_layout
from ptc.compiler.graph.stage_graphs import stage_info
from ptc.compiler.records.overlap import default_overlap

if TYPE_CHECKING:
    from ptc.compiler.records.decisions import Decisions


def with_stage_layouts(decisions: Decisions, whole: fx.GraphModule,
                       stages: Sequence[fx.GraphModule]) -> Decisions:
    """`decisions` with what the seam fixes: the tp layout the whole-graph passes recorded
    on `whole`, and each stage graph's parameter layout."""
    return dataclasses.replace(
        decisions, tensor_parallel=graph_record(whole).tensor_parallel,
        expert_parallel=graph_record(whole).expert_parallel,
        layouts={stage_info(s).index: stage_param_layout(s, decisions.plan.grad_ranks,
                                                         graph_record(whole).expert_parallel)
                 for s in stages})


def with_overlap(decisions: Decisions, stages: Sequence[fx.GraphModule]) -> Decisions:
    """`decisions` with each stage's overlap plan: the comm_overlap pass's, or where it did
    not run, one bucket per unit (`default_overlap`)."""
    plans = {}
    for stage in stages:
        index = stage_info(stage).index
        plans[index] = graph_record(stage).overlap or default_overlap(
            decisions.stage_layout(index), decisions.plan)
    return dataclasses.replace(decisions, overlap=plans)
