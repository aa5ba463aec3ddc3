"""How tensor parallelism splits parameters, and the slicing both sides of it agree on.

The tensor_parallel pass replaces each split parameter of the graph by its
tp-local shape and records here how the full tensor maps to the t local
ones; the runtime slices the full initial values with `ParamShard.local`
(every rank starts from the same full tensors as the eager model) and
joins the local tensors back with `ParamShard.join` (checkpoints, tests).

Terms: a parameter is split along one `dim` into `segments`, consecutive
pieces of that dim in the full tensor. Rank r holds the r-th 1/t of every
segment, concatenated in segment order. One segment is a plain contiguous
split (an MLP's up projection, a row-parallel weight's input features, a
vocabulary table); a fused q/k/v projection has three (its q, k and v
rows), so each rank holds its own q, k and v heads rather than a contiguous
slice of the fused output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamShard:
    """How one parameter is split over the tp ranks."""

    style: str
    """"colwise" (output features), "rowwise" (input features) or "vocab" (table rows)."""
    dim: int
    """The tensor dimension that is split."""
    segments: tuple[int, ...]
    """Sizes of the consecutive pieces of `dim` in the full tensor; each is split t ways."""
    full_shape: tuple[int, ...]
    """Shape of the whole parameter."""
    pad: int = 0
    """Zero rows appended to `dim` before splitting, so that a vocabulary not divisible by
    tp splits evenly (one segment, V + pad rows); they hold no token and get no gradient."""

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """Shape of one rank's part."""
        shape = list(self.full_shape)
        shape[self.dim] = (shape[self.dim] + self.pad) // tp
        return tuple(shape)

    def local(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        """Rank `rank`'s part of the full tensor (a new contiguous tensor)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"expected a tensor of shape {self.full_shape}, got {tuple(full.shape)}")
        if self.pad:
            zeros = list(full.shape)
            zeros[self.dim] = self.pad
            full = torch.cat([full, full.new_zeros(zeros)], self.dim)
        pieces = [seg.chunk(tp, self.dim)[rank] for seg in full.split(self.segments, self.dim)]
        return torch.cat(pieces, self.dim).contiguous()

    def join(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's part, in rank order (inverse of `local`)."""
        tp = len(parts)
        local_segments = [s // tp for s in self.segments]
        per_rank = [p.split(local_segments, self.dim) for p in parts]
        whole = torch.cat([torch.cat([pieces[i] for pieces in per_rank], self.dim)
                           for i in range(len(self.segments))], self.dim)
        return whole.narrow(self.dim, 0, self.full_shape[self.dim]) if self.pad else whole


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorParallelLayout:
    """Every split parameter of a lowered graph, by each of its names (tied weights too)."""

    tp: int
    """The tp degree the graph was lowered for."""
    params: Mapping[str, ParamShard]
    """Parameter name (every alias) -> its split; parameters not listed are replicated."""
    partial_grads: tuple[str, ...] = ()
    """Replicated parameters whose gradient each tp rank computes only a part of: used on
    the sequence split by sequence parallelism (norm weights, row-parallel biases) or on a
    rank's own heads (per-head q/k norms). The runtime sums them over tp once per step."""

    def local_values(self, values: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        """Full values by name -> this rank's values (replicated ones passed through)."""
        return {name: self.params[name].local(v, rank, self.tp) if name in self.params else v
                for name, v in values.items()}

    def full_shape(self, name: str, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The full shape of parameter `name`, whose local shape is `local_shape`."""
        shard = self.params.get(name)
        return shard.full_shape if shard is not None else tuple(local_shape)
