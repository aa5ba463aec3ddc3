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
    sent_at: dict[Action, int] = {}
    in_flight, peak = [0] * p, [0] * p
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
                if sent_at.get(send, step) >= step:
                    blocked.append(f"rank {r} waits in {action} for {send} from rank "
                                   f"{schedule.rank_of(send.stage)}")
                    continue
            row[r] = action
            in_flight[r] += 1 if action.kind == "F" else -(action.kind in BACKWARD_DONE)
            peak[r] = max(peak[r], in_flight[r])
            pc[r] += 1
            while pc[r] < len(program) and program[pc[r]].kind in ("SEND_F", "SEND_B"):
                sent_at[program[pc[r]]] = step
                pc[r] += 1
        if all(a is None for a in row):
            raise ScheduleError(f"schedule {schedule.kind} (pp = {p}, v = {schedule.virtual}, "
                                f"m = {schedule.microbatches}) deadlocks at step {step}: "
                                + "; ".join(blocked))
        steps.append(tuple(row))
    return Timeline(steps=tuple(steps), peak_in_flight=tuple(peak))
