"""Reading a stage graph's place in the pipeline off its record (`GraphRecord.stage`,
`.pipeline`): the records themselves are `ptc.compiler.records.stages`."""

from __future__ import annotations

from torch import fx

from ptc.compiler.graph.meta import graph_record
from ptc.compiler.records.stages import DATA_ROLES, PipelineInfo, StageInfo


def stage_info(gm: fx.GraphModule) -> StageInfo | None:
    """The StageInfo of a stage graph, None for any other graph."""
    return graph_record(gm).stage


def pipeline_info(gm: fx.GraphModule) -> PipelineInfo | None:
    """The PipelineInfo of a pipeline graph, None for any other graph."""
    return graph_record(gm).pipeline


def pipeline_stages(gm: fx.GraphModule) -> list[tuple[str, fx.GraphModule]]:
    """(submodule name, stage graph) of a pipeline graph, stage 0 first; [] for any other graph."""
    info = pipeline_info(gm)
    if info is None:
        return []
    return [(name, gm.get_submodule(name)) for name in info.stages]


def whole_graph_stage(gm: fx.GraphModule) -> StageInfo:
    """The StageInfo of an unsplit (tokens, targets) -> loss graph: the only stage of pp = 1."""
    return StageInfo(index=0, num_stages=1, rank=0, chunk=0, inputs=(), outputs=(),
                     data=DATA_ROLES, tied=(), atoms=())


def tied_names(gm: fx.GraphModule) -> tuple[str, ...]:
    """Names of the parameters of a stage graph that other stages also hold (none otherwise)."""
    info = stage_info(gm)
    return tuple(name for name, _ in info.tied) if info is not None else ()
