"""Simulating lowered schedules in lockstep, unit-time compute: the step × rank timeline
and each rank's peak in-flight micro-batches (what the memory model charges activations
for)."""

from __future__ import annotations

from dataclasses import dataclass

from ptc.compiler.schedule.actions import BACKWARD_DONE, Action, Schedule, ScheduleError
from ptc.compiler.schedule.lowering import (check, check_pairs, matching_send, needed_receive,
                                           per_rank_actions)

# ----------------------------------------------------------------- simulation


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    """What `simulate` saw: the compute action of every rank at every unit step."""

    steps: tuple[tuple[Action | None, ...], ...]
    """steps[t][r]: the action rank r computes at step t (None: idle)."""
    peak_in_flight: tuple[int, ...]
    """Per rank, the most stage micro-batches forwarded and not yet backwarded at once."""
    stage_peak_in_flight: tuple[int, ...]
    """Per stage, the most of its micro-batches forwarded and not yet backwarded at once."""
    peak_waiting_for_w: tuple[int, ...]
    """Per rank, the most stage micro-batches between their I and their W at once, the first
    stage's left out: with no input gradient to compute, its I does nothing and its W is
    the whole backward (`ptc.runtime.split_backward`)."""

    @property
    def bubble(self) -> float:
        """Idle share of all rank-steps."""
        cells = [a for row in self.steps for a in row]
        return sum(a is None for a in cells) / len(cells) if cells else 0.0


def simulate(schedule: Schedule) -> Timeline:
    """Run the lowered schedule in lockstep; ScheduleError if it is malformed or deadlocks."""
    check(schedule)
    programs = per_rank_actions(schedule)
    check_pairs(programs, schedule)
    n, p = schedule.num_stages, schedule.pp
    pc = [0] * p
    sent_at: dict[Action, int] = {}  # a send's step, or a compute's (what the rank reads)
    in_flight, peak = [0] * p, [0] * p
    stage_in_flight, stage_peak = [0] * n, [0] * n
    waiting, waiting_peak = [0] * p, [0] * p
    steps: list[tuple[Action | None, ...]] = []
    while any(pc[r] < len(programs[r]) for r in range(p)):
        step = len(steps)
        row: list[Action | None] = [None] * p
        blocked: list[str] = []
        for r in range(p):
            program = programs[r]
            while pc[r] < len(program) and program[pc[r]].kind in ("RECV_F", "RECV_B"):
                pc[r] += 1  # posting a receive never blocks
            if pc[r] == len(program):
                continue
            action = program[pc[r]]
            needed = needed_receive(action, n)
            if needed is not None:
                send = matching_send(needed[0])
                if schedule.rank_of(send.stage) == r:  # handed over on the rank: its compute
                    send = _local_source(action)
                if sent_at.get(send, step) >= step:
                    blocked.append(f"rank {r} waits in {action} for {send} from rank "
                                   f"{schedule.rank_of(send.stage)}")
                    continue
            row[r] = action
            sent_at[_local_source(action, made=True)] = step
            change = 1 if action.kind == "F" else -(action.kind in BACKWARD_DONE)
            in_flight[r] += change
            peak[r] = max(peak[r], in_flight[r])
            stage_in_flight[action.stage] += change
            stage_peak[action.stage] = max(stage_peak[action.stage], stage_in_flight[action.stage])
            waiting[r] += {"I": 1, "W": -1}.get(action.kind, 0) if action.stage else 0
            waiting_peak[r] = max(waiting_peak[r], waiting[r])
            pc[r] += 1
            while pc[r] < len(program) and program[pc[r]].kind in ("SEND_F", "SEND_B"):
                sent_at[program[pc[r]]] = step
                pc[r] += 1
        if all(a is None for a in row):
            raise ScheduleError(f"schedule {schedule.kind} (pp = {p}, v = {schedule.virtual}, "
                                f"m = {schedule.microbatches}) deadlocks at step {step}: "
                                + "; ".join(blocked))
        steps.append(tuple(row))
    return Timeline(steps=tuple(steps), peak_in_flight=tuple(peak),
                    stage_peak_in_flight=tuple(stage_peak), peak_waiting_for_w=tuple(waiting_peak))


def _local_source(action: Action, made: bool = False) -> Action:
    """The key of the compute that makes what `action` reads when both stages share a rank
    (the previous stage's F for an F, the next stage's B or I for a backward); with `made`,
    the key `action` itself is recorded under once it ran (B and I alike as "B")."""
    kind = "B" if action.kind in ("B", "I") else action.kind
    if made:
        return Action(action.stage, kind, action.microbatch)
    return Action(action.stage + (-1 if kind == "F" else 1), kind, action.microbatch)
