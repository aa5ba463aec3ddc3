"""How expert parallelism splits the routed experts' stacks over the ep ranks.

The expert_parallel pass gives each ep rank El = E/ep of a layer's E experts:
rank j holds experts j·El .. (j+1)·El - 1 of every stack ([experts, ., .]),
and the tokens routed to them travel there by all-to-all
(`ptc.ops.expert_parallel`). The split is a `ParamShard` of one segment along
dim 0, so the runtime slices initial values and re-addresses checkpoint
chunks as it does tp's (`ParamShard.local`, `ptc.runtime.checkpoint`). With
tensor parallelism too, the shapes here are tp-local: a rank's stack is the
ep slice of its tp slice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ptc.compiler.records.tp_layout import ParamShard

EXPERT = "expert"
"""The style of an expert stack's split (`ParamShard.style`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertParallelLayout:
    """Every expert stack of a lowered graph, by each of its names, and the ep degree."""

    ep: int
    """Ranks the experts are spread over."""
    params: Mapping[str, ParamShard]
    """Stack name (every alias) -> its split along dim 0 (full_shape: tp-local)."""
    layers: Mapping[int, int]
    """Layer index -> routed experts of that layer's block (what `ptc explain` and the
    memory model read)."""

    def local_values(self, values: Mapping[str, torch.Tensor], rank: int
                     ) -> dict[str, torch.Tensor]:
        """Values by name (tp-local where tp splits them) -> this ep rank's."""
        return {name: self.params[name].local(v, rank, self.ep) if name in self.params else v
                for name, v in values.items()}

    def is_expert(self, name: str) -> bool:
        """Whether parameter `name` is an expert stack (held 1/ep per rank)."""
        return name in self.params
