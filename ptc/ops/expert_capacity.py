"""Capacity per expert: the rows a mixture-of-experts layer computes at most per expert.

With `moe { capacity_factor = f }` each expert of a layer computes at most
C = ceil(f · N / E) of the N rows a rank routes to the layer (N = its tokens
times the top-k, before any exchange; E the experts), as Megatron-LM's
--moe-expert-capacity-factor: the rows of an expert over C are dropped, and
a dropped row adds nothing to its token's output (its expert output is zero,
whatever its routing weight). Which rows go: `probs`, those of the lowest
routing weight; `position`, the last in the expert's group (the order the
layer sorted its rows in).

| op                     | forward                                   | backward            |
|------------------------|-------------------------------------------|---------------------|
| `keep_within_capacity` | indices of the rows kept, their offsets   | none (indices)      |
| `restore_dropped`      | kept rows' outputs back in place, zeros   | the kept rows' part |
|                        | for the dropped                           |                     |

The rows kept stay grouped by expert (their indices ascend), so the grouped
products read them with the new offsets as they read all the rows. The
rows dropped in a forward are counted in the entered `RoutedTokens` session.
"""

from __future__ import annotations

import math

import torch

from ptc.ops.expert_parallel import RoutedTokens, expert_counts


def keep_within_capacity(x: torch.Tensor, offs: torch.Tensor, weights: torch.Tensor | None,
                         factor: float, policy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept, offs_kept): the indices of the rows of `x` (grouped by expert, cumulative
    group ends `offs`) each expert computes within its capacity ceil(factor · N / E), in
    ascending order, and the kept groups' cumulative ends (offs's dtype). `weights`: each
    row's routing weight (policy "probs"); None for "position"."""
    rows, experts = x.shape[0], offs.shape[0]
    capacity = math.ceil(factor * rows / experts)
    if x.is_meta or offs.is_meta:  # shapes only: as many rows as the capacities allow
        return (torch.empty(min(rows, capacity * experts), dtype=torch.int64, device=x.device),
                offs.new_empty(offs.shape))
    counts = expert_counts(offs.detach())
    expert = torch.repeat_interleave(torch.arange(experts, device=counts.device), counts)
    order = torch.arange(rows, device=counts.device)
    if policy == "probs":  # by expert, then by weight, highest first
        by_weight = torch.argsort(-weights.detach().reshape(rows), stable=True)
        order = by_weight[torch.argsort(expert[by_weight], stable=True)]
    rank = torch.empty_like(order)
    rank[order] = torch.arange(rows, device=counts.device) - (torch.cumsum(counts, 0)
                                                              - counts)[expert[order]]
    kept = torch.nonzero(rank < capacity).reshape(-1)
    session = RoutedTokens.current()
    if session is not None:
        session.drop(rows - kept.numel())
    ends = torch.cumsum(torch.clamp(counts, max=capacity), 0)
    return kept, ends.to(offs.dtype)


def restore_dropped(y: torch.Tensor, kept: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The rows of `rows`' length: the kept rows' outputs `y` at their places, zeros where
    rows were dropped. Backward: the gradient of each kept row (autograd's index_copy)."""
    out = y.new_zeros((rows.shape[0], *y.shape[1:]))
    return out.index_copy(0, kept, y)
