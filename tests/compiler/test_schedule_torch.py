"""Every ptc schedule is a valid schedule to torch pipelining.

Each rank's compute actions, translated into `torch.distributed.pipelining`'s own
`_Action`s (the kinds share their letters: F, B, I, W), pass that library's
`_validate_schedule` (each stage's F before its B or I, I before W, every
micro-batch complete); with the sends and receives torch's `_add_send_recv` places
(its receives block, so each goes right before the compute that needs it), they pass
its `_simulate_comms_compute` (every receive matched by a send, no deadlock). ptc
posts its receives earlier, asynchronously (`ptc.compiler.schedule.lowering`): its
own sends are checked there to follow the same compute, as torch's do. Stages are placed
on ranks as ptc places them (`Schedule.rank_of`: a V for zbv, as torch's
`generate_stage_to_rank_mapping(style="v")`).

ZB-V's order is ptc's own (`ptc.compiler.schedule.build._v_shape`); simulated with
unit-time actions it takes as many steps, with as many micro-batches in flight per rank,
as the order torch's `ScheduleZBVZeroBubble` computes for the same p and m. DualPipeV's is
torch's `ScheduleDualPipeV` order action for action, each of its OVERLAP_F_B pairs as
the pair's F then its B (ptc's runtime runs them one after the other)."""

from __future__ import annotations

import types

import pytest
from torch.distributed.pipelining.schedules import (ScheduleDualPipeV, ScheduleZBVZeroBubble,
                                                    _Action,
                                                    _add_send_recv, _ComputationType,
                                                    _simulate_comms_compute, _validate_schedule)

from ptc.compiler.schedule.actions import Action, Schedule
from ptc.compiler.schedule.build import build_schedule
from ptc.compiler.schedule.lowering import per_rank_actions
from ptc.compiler.schedule.simulation import simulate

CASES = [("gpipe", 4, 4, 1), ("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2),
         ("interleaved", 4, 8, 2), ("zero_bubble", 2, 4, 1), ("zero_bubble", 4, 8, 1),
         ("zero_bubble", 4, 16, 1), ("zero_bubble", 8, 8, 1), ("zero_bubble", 2, 4, 2),
         ("zero_bubble", 4, 8, 2), ("zbv", 2, 4, 2), ("zbv", 2, 3, 2), ("zbv", 4, 8, 2),
         ("zbv", 4, 5, 2), ("zbv", 8, 16, 2), ("dualpipev", 2, 4, 2), ("dualpipev", 4, 8, 2),
         ("dualpipev", 4, 13, 2), ("dualpipev", 8, 16, 2)]


def torch_actions(kind: str, p: int, m: int, v: int) -> dict[int, list[_Action]]:
    """Each rank's compute actions of ptc's schedule as torch pipelining's actions."""
    schedule = build_schedule(kind, p, m, v)
    return {rank: [_Action(a.stage, _ComputationType(a.kind), a.microbatch) for a in actions]
            for rank, actions in enumerate(schedule.ranks)}


@pytest.mark.parametrize("kind,p,m,v", CASES)
def test_torch_pipelining_validates_the_schedule(kind: str, p: int, m: int, v: int) -> None:
    compute = torch_actions(kind, p, m, v)
    _validate_schedule(compute, p, p * v, m)
    rank_of = build_schedule(kind, p, m, v).rank_of
    with_comms = _add_send_recv(compute, rank_of, p * v)
    _simulate_comms_compute(with_comms, rank_of, p * v)


@pytest.mark.parametrize("kind,p,m,v", CASES)
def test_ptc_sends_what_torch_sends_after_the_same_compute(kind: str, p: int, m: int,
                                                          v: int) -> None:
    compute = torch_actions(kind, p, m, v)
    rank_of = build_schedule(kind, p, m, v).rank_of
    torch_sends = {rank: [(a, program[i - 1]) for i, a in enumerate(program)
                          if a.computation_type.value.startswith("SEND")]
                   for rank, program in _add_send_recv(compute, rank_of, p * v).items()}
    ptc_sends = {rank: [(a, program[i - 1]) for i, a in enumerate(program)
                        if a.computation_type.value.startswith("SEND")]
                 for rank, program in enumerate(
                     [[_Action(x.stage, _ComputationType(x.kind), x.microbatch) for x in prog]
                      for prog in per_rank_actions(build_schedule(kind, p, m, v))])}
    assert ptc_sends == torch_sends


def test_the_translation_keeps_every_kind() -> None:
    kinds = {a.computation_type.value for actions in torch_actions("zero_bubble", 2, 4, 1).values()
             for a in actions}
    assert kinds == {"F", "I", "W"}


def _torch_zbv(p: int, m: int) -> Schedule:
    """torch pipelining's ZB-V order for p ranks and m micro-batches, as a ptc schedule."""
    state = types.SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
    ranks = tuple(tuple(Action(a.stage_index, a.computation_type.value, a.microbatch_index)
                        for a in ScheduleZBVZeroBubble._calculate_single_rank_operations(
                            state, rank) if a is not None) for rank in range(p))
    return Schedule(kind="zbv", pp=p, virtual=2, microbatches=m, ranks=ranks)


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (3, 6), (4, 8), (4, 12), (8, 16), (8, 32)])
def test_zbv_takes_the_steps_and_memory_of_torchs_zbv(p: int, m: int) -> None:
    ours, theirs = (simulate(s) for s in (build_schedule("zbv", p, m, 2), _torch_zbv(p, m)))
    assert len(ours.steps) == len(theirs.steps) == 6 * m + p - 1
    assert ours.peak_in_flight == theirs.peak_in_flight == (2 * p,) * p


@pytest.mark.parametrize("p,m", [(2, 4), (2, 7), (3, 6), (4, 8), (4, 13), (8, 16), (8, 24)])
def test_dualpipev_is_torchs_order_with_each_overlapped_pair_in_turn(p: int, m: int) -> None:
    state = types.SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
    for rank, ours in enumerate(build_schedule("dualpipev", p, m, 2).ranks):
        theirs = [Action(a.stage_index, a.computation_type.value, a.microbatch_index)
                  for action in ScheduleDualPipeV._calculate_single_rank_operations(state, rank)
                  for a in (action.sub_actions or (action,))]
        assert list(ours) == theirs, f"rank {rank}"
