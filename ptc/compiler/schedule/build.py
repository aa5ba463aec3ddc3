"""Generating a schedule of a kind (GPipe, 1F1B, interleaved 1F1B) for p ranks, m
micro-batches and v chunks, or reading one back from its text, each checked deadlock-free
by simulation. See `ptc.compiler.schedule.actions` for the terms."""

from __future__ import annotations

from ptc.compiler.schedule.actions import HEADER, SCHEDULE_KINDS, Action, Schedule, ScheduleError
from ptc.compiler.schedule.simulation import simulate

# ------------------------------------------------------------------ generation


def required_microbatches(kind: str, pp: int) -> int:
    """Fewest micro-batches `kind` runs with on pp ranks.

    1F1B and interleaved 1F1B fill the pipeline with one micro-batch per
    rank before their steady state; with fewer, ranks wait for work that
    never comes in the shape the schedule assumes, and the bubble exceeds
    the step's useful work.
    """
    return 1 if kind == "gpipe" else pp


def build_schedule(kind: str, pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """Generate the `kind` schedule for p ranks, m micro-batches, v chunks; check it by simulation.

    Raises ScheduleError naming the numbers when m is too small for `kind`,
    when interleaving needs m divisible by p, or when the simulation finds a
    deadlock.
    """
    if kind not in SCHEDULE_KINDS:
        raise ScheduleError(f"unknown schedule {kind!r}; valid: {', '.join(SCHEDULE_KINDS)}")
    if pp < 1 or microbatches < 1 or virtual < 1:
        raise ScheduleError(f"a schedule needs pp, micro-batches and virtual stages >= 1, got "
                            f"pp = {pp}, m = {microbatches}, v = {virtual}")
    if (kind == "interleaved") != (virtual > 1):
        raise ScheduleError(f"schedule {kind} with virtual_stages = {virtual}: only the "
                            f"interleaved schedule has (and needs) virtual_stages >= 2")
    need = required_microbatches(kind, pp)
    if microbatches < need:
        raise ScheduleError(
            f"schedule {kind} with pp = {pp} needs at least {need} micro-batches per step "
            f"(one in flight per pipeline rank), got {microbatches}: raise global_batch or "
            f"parallel.microbatches, or lower micro_batch")
    if kind == "interleaved" and microbatches % pp:
        raise ScheduleError(
            f"the interleaved schedule runs micro-batches in groups of pp = {pp}; "
            f"micro-batches = {microbatches} is not divisible by {pp}")
    make = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved}[kind]
    ranks = tuple(tuple(make(r, pp, microbatches, virtual)) for r in range(pp))
    schedule = Schedule(kind=kind, pp=pp, virtual=virtual, microbatches=microbatches,
                        ranks=ranks)
    simulate(schedule)
    return schedule


def schedule_for(plan) -> Schedule:
    """The plan's schedule; with pp = 1, the one-stage schedule (each micro-batch's F, then B)."""
    par = plan.parallel
    if par.pp == 1:
        return one_stage_schedule(plan.num_microbatches)
    return build_schedule(par.schedule, par.pp, plan.num_microbatches, par.virtual_stages)


def one_stage_schedule(microbatches: int) -> Schedule:
    """The schedule of an unsplit model: F and B of each micro-batch in turn, nothing to send."""
    return build_schedule("1f1b", 1, microbatches)


def _gpipe(rank: int, p: int, m: int, v: int) -> list[Action]:
    return [Action(rank, "F", i) for i in range(m)] + [Action(rank, "B", i) for i in range(m)]


def _one_f_one_b(rank: int, p: int, m: int, v: int) -> list[Action]:
    warmup = min(p - rank - 1, m)
    actions = [Action(rank, "F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [Action(rank, "F", warmup + i), Action(rank, "B", i)]
    return actions + [Action(rank, "B", i) for i in range(m - warmup, m)]


def _interleaved(rank: int, p: int, m: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B: micro-batches in groups of p, chunk by chunk.

    Rank r's k-th forward is chunk (k // p) % v on micro-batch
    (k // (p·v))·p + k % p; backward walks the chunks in reverse. Rank r
    runs 2(p - 1 - r) + (v - 1)·p forwards before its first backward.
    """
    total = m * v

    def at(k: int, backward: bool) -> Action:
        chunk = (k // p) % v
        if backward:
            chunk = v - 1 - chunk
        micro = (k // (p * v)) * p + k % p
        return Action(chunk * p + rank, "B" if backward else "F", micro)

    warmup = min(2 * (p - 1 - rank) + (v - 1) * p, total)
    actions = [at(k, False) for k in range(warmup)]
    for i in range(total - warmup):
        actions += [at(warmup + i, False), at(i, True)]
    return actions + [at(k, True) for k in range(total - warmup, total)]


def parse_schedule(text: str) -> Schedule:
    """Read `format_schedule`'s text (a hand-written schedule too); check it by simulation."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    header = HEADER.match(lines[0]) if lines else None
    if header is None:
        raise ScheduleError("a schedule starts with \"schedule KIND pp=P v=V m=M\", got "
                            f"{lines[0] if lines else 'nothing'!r}")
    ranks = []
    for r, line in enumerate(lines[1:]):
        label, _, body = line.partition(":")
        if label.strip() != f"rank {r}":
            raise ScheduleError(f"line {r + 2}: expected \"rank {r}: ...\", got {line!r}")
        ranks.append(tuple(Action.parse(word) for word in body.split()))
    schedule = Schedule(kind=header[1], pp=int(header[2]), virtual=int(header[3]),
                        microbatches=int(header[4]), ranks=tuple(ranks))
    simulate(schedule)
    return schedule
