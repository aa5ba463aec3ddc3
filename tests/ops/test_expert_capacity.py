"""Each expert computes at most its capacity of a layer's routed rows (`ptc.ops.expert_capacity`).

Checked against the rule written out row by row: C = ceil(f · N / E); per
expert, its rows ranked by routing weight (highest first, ties by row) under
"probs" or by position under "position", the first C kept. The kept indices
ascend (the groups stay in order), the offsets are the kept groups' ends, and
`restore_dropped` puts each kept row's output back at its row, zeros elsewhere,
with its gradient flowing to the kept rows only. Rows dropped in a forward are
counted in the entered `RoutedTokens` session.
"""

from __future__ import annotations

import math

import pytest
import torch

from ptc.ops.expert_capacity import keep_within_capacity, restore_dropped
from ptc.ops.expert_parallel import RoutedTokens


def _case(seed: int, rows: int, experts: int):
    g = torch.Generator().manual_seed(seed)
    expert = torch.sort(torch.randint(0, experts, (rows,), generator=g)).values
    counts = torch.bincount(expert, minlength=experts)
    return expert, torch.cumsum(counts, 0).to(torch.int32), torch.rand(rows, generator=g)


def _kept_by_hand(expert: torch.Tensor, weights: torch.Tensor, capacity: int,
                  policy: str) -> list[int]:
    kept = []
    for e in expert.unique().tolist():
        members = [i for i in range(len(expert)) if expert[i] == e]
        if policy == "probs":
            members.sort(key=lambda i: (-float(weights[i]), i))
        kept += members[:capacity]
    return sorted(kept)


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25, 4.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_expert_keeps_its_capacity_of_rows(policy: str, factor: float, seed: int) -> None:
    rows, experts = 24, 4
    expert, offs, weights = _case(seed, rows, experts)
    capacity = math.ceil(factor * rows / experts)
    with RoutedTokens() as routed:
        kept, ends = keep_within_capacity(torch.empty(rows, 3), offs, weights, factor, policy)
    assert kept.tolist() == _kept_by_hand(expert, weights, capacity, policy)
    counts = torch.bincount(expert, minlength=experts).clamp(max=capacity)
    assert ends.dtype == offs.dtype and ends.tolist() == torch.cumsum(counts, 0).tolist()
    assert routed.dropped == rows - kept.numel()
    if factor >= experts:  # C >= N: nothing can be dropped
        assert kept.tolist() == list(range(rows))


def test_restore_puts_kept_rows_back_and_zeros_the_dropped() -> None:
    y = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    kept = torch.tensor([0, 2, 5])
    out = restore_dropped(y, kept, torch.empty(6))
    assert torch.equal(out[kept], y.detach()) and not out[[1, 3, 4]].any()
    grad = torch.randn(6, 2, dtype=torch.float64)
    out.backward(grad)
    assert torch.equal(y.grad, grad[kept])


def test_meta_shapes_are_every_expert_full() -> None:
    kept, ends = keep_within_capacity(torch.empty(24, 3, device="meta"),
                                      torch.empty(4, dtype=torch.int32, device="meta"),
                                      None, 0.5, "position")
    assert kept.shape == (12,) and ends.shape == (4,)
