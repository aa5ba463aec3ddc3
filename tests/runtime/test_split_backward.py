"""A backward split into I (input gradients) and W (weight gradients) gives what one
backward gives, and W runs nothing of the input side (`ptc.runtime.split_backward`).

In float64, on a stage with a LayerNorm, a GELU, one linear applied twice (its weight
read by two matmuls, so their branch nodes form one group) and a frozen linear: the
input gradient of I and every weight's gradient after W equal a plain
`torch.autograd.backward` of the same computation exactly (the same kernels, in the
same order per gradient). I leaves every weight's gradient untouched; W accumulates
each weight once, through autograd's accumulation, so gradient hooks fire as in a
whole backward; the GELU's backward (input side only) runs in I and never in W. A
checkpointed region read by both is recomputed once, full or selective, and gives the
same gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ptc.ops.recompute import checkpoint_region, recompute_once
from ptc.runtime.split_backward import input_backward


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16, dtype=torch.float64)
        self.norm = nn.LayerNorm(16, dtype=torch.float64)
        self.act = nn.GELU()
        self.shared = nn.Linear(16, 16, dtype=torch.float64)
        self.frozen = nn.Linear(16, 8, dtype=torch.float64).requires_grad_(False)

    def forward(self, x):
        h = self.act(self.norm(self.up(x)))
        return self.frozen(self.shared(torch.tanh(self.shared(h))))


def _stage_and_input(seed: int = 0) -> tuple[Stage, torch.Tensor]:
    torch.manual_seed(seed)
    return Stage(), torch.randn(4, 8, dtype=torch.float64, requires_grad=True)


def test_i_then_w_give_what_one_backward_gives() -> None:
    whole, x = _stage_and_input()
    split, x2 = copy.deepcopy(whole), x.detach().clone().requires_grad_(True)
    seed = torch.randn(4, 8, dtype=torch.float64)
    whole(x).backward(seed)

    out = split(x2)
    accumulated = []
    for name, w in split.named_parameters():
        if w.requires_grad:
            w.register_post_accumulate_grad_hook(lambda _, name=name: accumulated.append(name))
    gelu = out.grad_fn
    while type(gelu).__name__ != "GeluBackward0":  # walk down to the GELU's backward node
        gelu = next(n for n, _ in gelu.next_functions if n is not None
                    and type(n).__name__ != "AccumulateGrad")
    gelu_runs = []
    gelu.register_prehook(lambda grads: gelu_runs.append(1))

    (dx,), weights = input_backward([out], [seed], [x2], list(split.parameters()))
    assert torch.equal(dx, x.grad)
    assert all(w.grad is None for w in split.parameters())
    assert gelu_runs == [1] and accumulated == []

    weights.run()
    assert gelu_runs == [1], "W ran the GELU's backward again: it walked the input side"
    assert sorted(accumulated) == sorted(n for n, w in split.named_parameters() if w.requires_grad)
    for (name, w), w2 in zip(whole.named_parameters(), split.parameters()):
        if w.requires_grad:
            assert torch.equal(w.grad, w2.grad), name
        else:
            assert w2.grad is None, name


def test_a_stage_whose_inputs_need_no_gradient_runs_all_in_w() -> None:
    """The first stage reads token ids: I has nothing to compute, W is the whole backward."""
    whole, x = _stage_and_input(1)
    split = copy.deepcopy(whole)
    data = x.detach()
    whole(data).sum().backward()
    loss = split(data).sum()
    got, weights = input_backward([loss], None, [data], list(split.parameters()))
    assert got == [None] and all(w.grad is None for w in split.parameters())
    weights.run()
    for w, w2 in zip(whole.parameters(), split.parameters()):
        assert (w.grad is None and w2.grad is None) or torch.equal(w.grad, w2.grad)


def test_a_loss_seeds_itself() -> None:
    """On the last stage I starts from the loss (no gradient given: one)."""
    whole, x = _stage_and_input(2)
    split, x2 = copy.deepcopy(whole), x.detach().clone().requires_grad_(True)
    (whole(x) ** 2).mean().backward()
    (dx,), weights = input_backward([(split(x2) ** 2).mean()], None, [x2],
                                    list(split.parameters()))
    weights.run()
    assert torch.equal(dx, x.grad)
    assert torch.equal(split.up.weight.grad, whole.up.weight.grad)


class Checkpointed(nn.Module):
    """A region of two linears around a tanh, counting its forwards."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8, dtype=torch.float64)
        self.second = nn.Linear(8, 8, dtype=torch.float64)
        self.runs = 0

    def forward(self, x):
        self.runs += 1
        return self.second(torch.tanh(self.first(x)))


@pytest.mark.parametrize("save_matmuls", [False, True], ids=["full", "selective"])
def test_a_checkpointed_region_read_by_i_and_w_is_recomputed_once(save_matmuls: bool) -> None:
    """Full and selective recompute under a split backward: the region's forward runs
    twice in all (the forward, and one recomputation that I's and W's autograd calls
    share; torch's checkpoint would recompute once per call), and the gradients equal an
    unsplit backward of the plain region exactly."""
    torch.manual_seed(2)
    region, x = Checkpointed(), torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    plain = copy.deepcopy(region)
    seed = torch.randn(4, 8, dtype=torch.float64)
    plain(x).backward(seed)
    x2 = x.detach().clone().requires_grad_(True)
    with recompute_once():
        out = checkpoint_region(region, x2, save_matmuls=save_matmuls)
    (dx,), weights = input_backward([out], [seed], [x2], list(region.parameters()))
    assert region.runs == 2 and torch.equal(dx, x.grad)
    weights.run()
    assert region.runs == 2, "W recomputed the region again"
    for w, w2 in zip(plain.parameters(), region.parameters()):
        assert torch.equal(w.grad, w2.grad)


def test_a_region_rebuilt_once_also_runs_a_whole_backward() -> None:
    """DualPipeV runs some backwards whole (B): each saved tensor is then read once."""
    torch.manual_seed(3)
    region, x = Checkpointed(), torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    plain = copy.deepcopy(region)
    plain(x).sum().backward()
    with recompute_once():
        checkpoint_region(region, x.detach().requires_grad_(True)).sum().backward()
    assert region.runs == 2
    assert all(torch.equal(w.grad, w2.grad) for w, w2 in zip(plain.parameters(),
                                                                region.parameters()))
