"""A tp rank's share of the training state: its weight slices, its part of the norm, the whole back.

The dp/ZeRO machinery (`ptc.runtime.params`) works on whatever tensors the
lowered graph holds; under tensor parallelism those are the tp-local
parameters (`ptc.compiler.records.tp_layout`). Three things need the tp axis:

- initial values: every rank builds the same full tensors as the eager model
  and keeps its slice (`rank_values`);
- the global gradient norm: split parameters contribute their local squares,
  replicated ones (norms, row-parallel biases) hold the same gradient on
  every tp rank and must be counted once (`replicated_ranges` tells the
  optimizer where they are in each unit's master);
- sequence parallelism: a replicated parameter used on the split sequence
  gets from each rank the gradient of its part of the sequence only; those
  gradients are summed over tp once per step, with one collective
  (`partial_grad_ranges`, `sum_partial_grads`);
- full weights for checkpoints and tests: gathered over tp and joined
  (`join_over_tp`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from ptc.compiler.records.ep_layout import ExpertParallelLayout
from ptc.compiler.records.params import ParamLayout
from ptc.compiler.records.program import Program
from ptc.compiler.records.tp_layout import TensorParallelLayout
from ptc.ops.comm import all_reduce_bucket, group_size
from ptc.plan import Plan
from ptc.runtime.init import InitialValue, initial_params
from ptc.runtime.params import UnitState, slot_ranges


def rank_values(program: Program, model: nn.Module, initial_value: InitialValue,
                values: Mapping[str, torch.Tensor] | None, tp_rank: int,
                ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """The initial weights this rank holds, by canonical name: `values` (full tensors) or the
    plan's own initial weights (`initial_params` of `model`), cut to the rank's tp slice
    under tensor parallelism, then to its ep rank's experts under expert parallelism."""
    plan, layout, tp = program.plan, program.layout, program.tensor_parallel
    experts = program.decisions.expert_parallel
    if values is None:
        full = ParamLayout(units=layout.units, params={
            name: dataclasses.replace(slot, shape=_full_shape(name, slot.shape, tp, experts))
            for name, slot in layout.params.items()})
        values = initial_params(plan, full, model, initial_value)
    values = dict(values) if tp is None else tp.local_values(values, tp_rank)
    return values if experts is None else experts.local_values(values, ep_rank)


def _full_shape(name: str, shape: tuple[int, ...], tp: TensorParallelLayout | None,
                experts: ExpertParallelLayout | None) -> tuple[int, ...]:
    """The whole parameter's shape, from the shape a rank holds (ep-, then tp-local)."""
    if experts is not None and experts.is_expert(name):
        shape = experts.params[name].full_shape
    return shape if tp is None else tp.full_shape(name, shape)


def seed_dropout(plan: Plan, tp_group: dist.ProcessGroup | None, rank: int) -> None:
    """Seed this rank's RNG: dropout differs per rank, repeatably, but not across a tp
    group, whose ranks must drop the same elements of the activations they all hold."""
    leader = dist.get_process_group_ranks(tp_group)[0] if tp_group else rank
    torch.manual_seed(plan.runtime.seed + leader)


def replicated_ranges(units: list[UnitState], tp: TensorParallelLayout, *,
                      zero: int) -> list[list[tuple[int, int]]]:
    """Per unit, the [start, end) element ranges of its master that hold replicated parameters.

    The master is the unit's whole flat buffer at ZeRO-0 and the rank's shard
    from ZeRO-1 on (padding is zero and needs no range).
    """
    return slot_ranges(units, lambda slot: slot.name not in tp.params, whole=zero == 0)


def partial_grad_ranges(units: list[UnitState], tp: TensorParallelLayout, *,
                        zero: int) -> list[list[tuple[int, int]]]:
    """Per unit, the ranges of its gradient buffer (whole at ZeRO 0-1, the rank's shard from
    ZeRO-2) that hold parameters with partial gradients per tp rank (`tp.partial_grads`)."""
    partial = set(tp.partial_grads)
    return slot_ranges(units, lambda slot: not partial.isdisjoint(slot.aliases), whole=zero < 2)


def sum_partial_grads(units: list[UnitState], ranges: list[list[tuple[int, int]]],
                      group: dist.ProcessGroup | None) -> None:
    """Sum the partial gradients of replicated parameters over tp, with one collective.

    Call once per step, after the dp reduction (the two sums commute: tp
    ranks of one dp coordinate hold the same ranges), before clipping.
    """
    pieces = [unit.grad[a:b] for unit, spans in zip(units, ranges) for a, b in spans]
    if pieces and group_size(group) > 1:
        for work in all_reduce_bucket(pieces, group):
            work.wait()


def join_over_tp(values: Mapping[str, torch.Tensor],
                 tp: TensorParallelLayout | ExpertParallelLayout,
                 group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """Full tensors from every tp rank's local ones (collective over `group`); given an
    expert-parallel layout and the ep group, the tp-local stacks from every ep rank's."""
    world = group_size(group)
    out = dict(values)
    for name, local in values.items():  # the same order on every rank: the layout's
        shard = tp.params.get(name)
        if shard is None or world == 1:
            continue
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous(), group=group)
        out[name] = shard.join(parts)
    return out
