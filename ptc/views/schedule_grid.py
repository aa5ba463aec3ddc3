"""The pipeline schedule as a step × rank grid of actions (`ptc inspect --schedule`),
narrowed to some steps or ranks."""

from __future__ import annotations

from collections.abc import Sequence

from ptc.compiler.schedule.actions import Schedule
from ptc.compiler.schedule.build import schedule_for
from ptc.compiler.schedule.simulation import simulate


def format_grid(schedule: Schedule, steps: Sequence[int] | None = None,
                ranks: Sequence[int] | None = None) -> str:
    """The simulated step × rank grid: which action each rank computes at each unit step.

    "." marks an idle step (the bubble). `steps` and `ranks` narrow the grid
    to those rows and columns (a long schedule has thousands of steps); the
    summary line (steps, bubble share, each rank's peak in-flight
    micro-batches) is always of the whole schedule.
    """
    timeline = simulate(schedule)
    steps = range(len(timeline.steps)) if steps is None else steps
    ranks = range(schedule.pp) if ranks is None else ranks
    width = max(6, max(len(str(a)) for row in timeline.steps for a in row if a) + 1)
    head = f"{schedule.kind} schedule: pp={schedule.pp} v={schedule.virtual} " \
           f"m={schedule.microbatches}, {schedule.num_stages} stages on {schedule.pp} ranks"
    shown = "".join(f"{f'rank {r}':<{width + 1}}" for r in ranks)
    lines = [head, f"step  {shown}".rstrip()]
    for t in steps:
        row = timeline.steps[t]
        cells = "".join(f"{str(row[r]) if row[r] else '.':<{width + 1}}" for r in ranks)
        lines.append(f"{t:>4}  {cells}".rstrip())
    lines.append(f"{len(timeline.steps)} steps, bubble {timeline.bubble:.0%}, peak in flight "
                 f"per rank: {' '.join(map(str, timeline.peak_in_flight))}")
    return "\n".join(lines) + "\n"


def parse_selection(text: str, count: int, what: str) -> list[int]:
    """"A:B" (B excluded; either end may be left out), "A" or "A,B,C" -> indices below `count`;
    ValueError naming `what` and the valid range otherwise."""
    valid = f"give N, A:B or A,B,C with numbers 0 .. {count - 1}"
    try:
        if ":" in text:
            low, _, high = text.partition(":")
            picked = list(range(int(low or 0), min(int(high or count), count)))
        else:
            picked = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{what} {text!r}: {valid}") from None
    if not picked or any(not 0 <= i < count for i in picked):
        raise ValueError(f"{what} {text!r}: {valid}")
    return picked


def render_schedule(program_or_plan, steps: str | None = None, ranks: str | None = None) -> str:
    """The step × rank grid of a Program's schedule, or of the schedule a Plan compiles to;
    `steps` and `ranks` select rows and columns (`parse_selection`)."""
    plan = getattr(program_or_plan, "plan", program_or_plan)
    if plan.parallel.pp == 1:
        return "pp = 1: no pipeline schedule (every rank runs the whole model)\n"
    schedule = getattr(program_or_plan, "schedule", None)
    schedule = schedule if schedule is not None else schedule_for(plan)
    rows = None if steps is None else parse_selection(
        steps, len(simulate(schedule).steps), "--steps")
    columns = None if ranks is None else parse_selection(ranks, schedule.pp, "--ranks")
    return format_grid(schedule, rows, columns)
