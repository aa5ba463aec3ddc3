"""What a pipeline stage graph takes, gives and shares, recorded on its GraphModule.

The pipeline_split pass cuts the captured graph into p·v *stage graphs*
(stage s runs on pipeline rank `ptc.plan.stage_rank(s)` as its chunk s // p). Each stage graph's
record (`ptc.compiler.records.graph_meta.GraphRecord`) holds its `StageInfo`; the
*pipeline graph* — the GraphModule the pass returns, whose submodules
`stage_0`, `stage_1`, ... are the stage graphs and whose own graph calls them
in order — holds a `PipelineInfo`. An unsplit graph is one stage
(`whole_graph_stage`).

Terms:
- a *boundary value* is a tensor that stage s - 1 sends to stage s: an
  activation made before the cut and used after it (or passed on through
  stage s to a later one). Its shape is the captured one (micro-batch b);
- a *data input* is a placeholder of the captured graph, named by its role
  (`DATA_ROLES`: the captured graph takes tokens, then targets, whatever
  the model calls them): every rank reads its micro-batch from the data
  source itself, so data inputs never travel between stages;
- a *tied weight* is one parameter used by more than one stage (an input
  embedding shared with the LM head): each of those stages holds a copy, and
  the copies' gradients are summed between the stages every step.

Calling convention of a stage graph: its placeholders are its boundary
inputs in `inputs` order, then its data inputs in `data` order. A stage
that is not the last returns the tuple of its `outputs`; the last returns
the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DATA_ROLES = ("tokens", "targets")
"""What the captured graph's placeholders are, in order."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Boundary:
    """One tensor crossing from a stage to the next."""

    name: str
    """Name of the node of the captured graph that made it (the placeholder's name)."""
    shape: tuple[int, ...]
    """Shape of one micro-batch's value."""
    dtype: torch.dtype
    """Element type."""
    requires_grad: bool
    """Whether its gradient flows back across the cut (it depends on a parameter)."""

    @property
    def nbytes(self) -> int:
        """Bytes of one micro-batch's value."""
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


@dataclass(frozen=True, slots=True, kw_only=True)
class StageInfo:
    """Where a stage graph sits in the pipeline and what crosses its edges."""

    index: int
    """Stage s, 0 .. p·v - 1."""
    num_stages: int
    """p·v."""
    rank: int
    """Pipeline rank that runs it (`ptc.plan.stage_rank`: s % p, or in a V for zbv)."""
    chunk: int
    """Its chunk s // p on that rank."""
    inputs: tuple[Boundary, ...]
    """Boundary values received from stage s - 1, in placeholder order."""
    outputs: tuple[Boundary, ...]
    """Boundary values sent to stage s + 1, in output order (empty on the last stage)."""
    data: tuple[str, ...]
    """Roles of the data inputs it reads ("tokens", "targets"), after the boundary placeholders."""
    tied: tuple[tuple[str, str], ...]
    """(name in this stage, canonical name) of each tied weight it holds a copy of."""
    atoms: tuple[str, ...]
    """The graph pieces it holds, in order ("embed", "layers.0", ..., "head")."""

    @property
    def is_first(self) -> bool:
        """Whether it is stage 0."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """Whether it computes the loss."""
        return self.index == self.num_stages - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineInfo:
    """The split as a whole: stage count, placement, and the tied weights."""

    pp: int
    """Pipeline ranks p."""
    virtual: int
    """Chunks per rank v."""
    stages: tuple[str, ...]
    """Submodule names of the stage graphs, stage 0 first."""
    tied: tuple[tuple[str, tuple[int, ...]], ...]
    """(canonical name, stages holding a copy) of each tied weight."""
