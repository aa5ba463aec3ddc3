"""Generating a schedule of a kind (GPipe, 1F1B, interleaved 1F1B, zero bubble, ZB-V) for p
ranks, m micro-batches and v chunks, or reading one back from its text, each checked
deadlock-free by simulation. See `ptc.compiler.schedule.actions` for the terms."""

from __future__ import annotations

import functools
from collections.abc import Callable

from ptc.compiler.schedule.actions import HEADER, Action, Schedule, ScheduleError
from ptc.compiler.schedule.simulation import Timeline, simulate
from ptc.plan import SCHEDULES, V_SHAPED

# ------------------------------------------------------------------ generation


def required_microbatches(kind: str, pp: int) -> int:
    """Fewest micro-batches `kind` runs with on pp ranks.

    1F1B and interleaved 1F1B fill the pipeline with one micro-batch per
    rank before their steady state; with fewer, ranks wait for work that
    never comes in the shape the schedule assumes, and the bubble exceeds
    the step's useful work.
    """
    if kind == "dualpipev":
        return 2 * pp
    return 1 if kind in ("gpipe", "zbv") else pp


def build_schedule(kind: str, pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """Generate the `kind` schedule for p ranks, m micro-batches, v chunks; check it by simulation.

    Raises ScheduleError naming the numbers when m is too small for `kind`,
    when interleaving needs m divisible by p, or when the simulation finds a
    deadlock.
    """
    if kind not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {kind!r}; valid: {', '.join(SCHEDULES)}")
    if pp < 1 or microbatches < 1 or virtual < 1:
        raise ScheduleError(f"a schedule needs pp, micro-batches and virtual stages >= 1, got "
                            f"pp = {pp}, m = {microbatches}, v = {virtual}")
    if kind in V_SHAPED and virtual != 2:
        raise ScheduleError(f"schedule {kind} places two chunks per rank in a V: it needs "
                            f"virtual_stages = 2, got {virtual}")
    if kind in ("gpipe", "1f1b", "interleaved") and (kind == "interleaved") != (virtual > 1):
        raise ScheduleError(f"schedule {kind} with virtual_stages = {virtual}: only the "
                            f"interleaved schedule has (and needs) virtual_stages >= 2")
    need = required_microbatches(kind, pp)
    if microbatches < need:
        per = "stage" if kind == "dualpipev" else "pipeline rank"
        raise ScheduleError(
            f"schedule {kind} with pp = {pp} needs at least {need} micro-batches per step "
            f"(one in flight per {per}), got {microbatches}: raise global_batch or "
            f"parallel.microbatches, or lower micro_batch")
    if virtual > 1 and microbatches % pp and kind not in V_SHAPED:
        raise ScheduleError(
            f"schedule {kind} with virtual_stages = {virtual} runs micro-batches in groups "
            f"of pp = {pp}; "
            f"micro-batches = {microbatches} is not divisible by {pp}")
    if kind == "zero_bubble":
        ranks = _weights_in_the_bubbles(pp, microbatches, virtual)
    elif kind == "zbv":
        ranks = _v_shape(pp, microbatches)
    elif kind == "dualpipev":
        ranks = tuple(_dual_pipe_v(r, pp, microbatches) for r in range(pp))
    else:
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


@functools.lru_cache(maxsize=256)
def simulated(kind: str, pp: int, microbatches: int, virtual: int) -> Timeline:
    """The `kind` schedule's simulation (remembered: the memory model reads it per layout)."""
    return simulate(build_schedule(kind, pp, microbatches, virtual))


def stage_peaks(kind: str, pp: int, microbatches: int, virtual: int) -> tuple[int, ...]:
    """Per stage, the most micro-batches forwarded and not yet done with (B or W) at once
    in the `kind` schedule's simulation (`Timeline.stage_peak_in_flight`)."""
    return simulated(kind, pp, microbatches, virtual).stage_peak_in_flight


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


def _weights_in_the_bubbles(p: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) on 1F1B's order, or
    interleaved 1F1B's for v >= 2: each backward split into I (the input gradients, which
    the previous stage waits for) and W (the weight gradients, which nothing waits for).

    The ranks run in lockstep, one action per unit step (a message sent in one step is
    there the next, as `simulate` runs them). A rank runs its next F or I in the base
    order when its input has arrived, and one of its pending Ws (the oldest) when it has
    not, instead of waiting. A micro-batch's activations stay until its W: a rank runs a
    pending W before a forward that would hold more micro-batches than the base schedule
    holds on its first rank (p under 1F1B), the most any rank holds there, so the
    activation memory of the job stays the base's while the later ranks keep Ws for the
    end of the step, when the input gradients travel back to the first. The Ws still
    pending after a rank's last I close its step. With unit-time actions the step takes
    3m·v + p - 1 units: the bubble of p - 1 is a third of 1F1B's 3(p - 1).
    """
    make = _one_f_one_b if v == 1 else _interleaved
    base = [[Action(a.stage, "I" if a.kind == "B" else a.kind, a.microbatch)
             for a in make(r, p, m, v)] for r in range(p)]
    cap = max(simulate(Schedule(kind="1f1b" if v == 1 else "interleaved", pp=p, virtual=v,
                                microbatches=m, ranks=tuple(tuple(make(r, p, m, v))
                                                            for r in range(p)))).peak_in_flight)
    cursor, in_flight = [0] * p, [0] * p
    pending: list[list[Action]] = [[] for _ in range(p)]

    def pick(r: int, arrived: Callable[[Action], bool]) -> Action | None:
        action = base[r][cursor[r]] if cursor[r] < len(base[r]) else None
        full = action is not None and action.kind == "F" and in_flight[r] >= cap
        if action is not None and not full and arrived(action):
            cursor[r] += 1
            if action.kind == "I":
                pending[r].append(Action(action.stage, "W", action.microbatch))
        elif pending[r]:
            action = pending[r].pop(0)
        else:
            return None
        in_flight[r] += {"F": 1, "W": -1}.get(action.kind, 0)
        return action

    return _in_lockstep(p, p * v, pick,
                        lambda: any(cursor[r] < len(base[r]) or pending[r] for r in range(p)))


def _v_shape(p: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 6): two
    chunks per rank in a V (rank r holds stages r and 2p - 1 - r, `ptc.plan.stage_rank`),
    each backward split into I and W as in `_weights_in_the_bubbles`.

    The ranks run in lockstep, one action per unit step. Each step a rank runs, of what
    has arrived: the I of the oldest micro-batch (of the lower stage on a tie: it is
    further along the backward); else, while it holds fewer than 2p chunk micro-batches
    (1F1B's activation memory on its first rank: p micro-batches of a rank's layers), the
    F of the oldest (of the higher stage on a tie); else a pending W, the last stage's
    first (its loss holds the largest activations), then the oldest. With unit-time
    actions a step takes 6m + p - 1 units for m >= 2p: a bubble of p - 1 half-stage units,
    half ZB-H1's, as torch pipelining's `ScheduleZBVZeroBubble` (the same step and peak
    in the simulation); each rank holds at most min(2p, 2m) chunk micro-batches.
    """
    n = 2 * p
    pending: list[list[Action]] = [[] for _ in range(p)]
    forwarded, backwarded = [0] * n, [0] * n  # per stage: micro-batches through F, I
    in_flight = [0] * p

    def pick(r: int, arrived: Callable[[Action], bool]) -> Action | None:
        ready = [(0, backwarded[s], s, "I") for s in (r, n - 1 - r)
                 if backwarded[s] < forwarded[s] and arrived(Action(s, "I", backwarded[s]))]
        ready += [(1, forwarded[s], -s, "F") for s in (r, n - 1 - r)
                  if forwarded[s] < m and in_flight[r] < 2 * p
                  and arrived(Action(s, "F", forwarded[s]))]
        if ready:
            _, micro, stage, kind = min(ready)
            action = Action(abs(stage), kind, micro)
            if kind == "F":
                forwarded[action.stage] += 1
                in_flight[r] += 1
            else:
                backwarded[action.stage] += 1
                pending[r].append(Action(action.stage, "W", micro))
            return action
        if not pending[r]:
            return None
        action = ([w for w in pending[r] if w.stage == n - 1] or pending[r])[0]
        pending[r].remove(action)
        in_flight[r] -= 1
        return action

    return _in_lockstep(p, n, pick, lambda: any(c < m for c in backwarded) or any(pending))


def _in_lockstep(p: int, stages: int, pick: Callable[[int, Callable[[Action], bool]],
                                                      Action | None],
                 unfinished: Callable[[], bool]) -> tuple[tuple[Action, ...], ...]:
    """Each rank's actions when the p ranks run in lockstep, one action per unit step,
    while `unfinished()`: `pick(rank, arrived)` chooses the rank's action of the step (None:
    it idles), `arrived(action)` saying whether what the action reads was made in an
    earlier step (a message sent in one step is there the next, as `simulate` runs them)."""
    done_at: dict[tuple[str, int, int], int] = {}
    ranks: list[list[Action]] = [[] for _ in range(p)]
    step = 0
    while unfinished():
        arrived = functools.partial(_arrived, stages=stages, done_at=done_at, step=step)
        ran = []
        for r in range(p):
            action = pick(r, arrived)
            if action is not None:
                ranks[r].append(action)
                ran.append(action)
        for action in ran:
            done_at[action.kind, action.stage, action.microbatch] = step
        step += 1
    return tuple(tuple(actions) for actions in ranks)


def _dual_pipe_v(rank: int, p: int, m: int) -> tuple[Action, ...]:
    """DualPipeV (DeepSeek-V3's DualPipe cut in half, as torch pipelining's
    `ScheduleDualPipeV` runs it): two chunks in a V, rank r holding stage a = r and stage
    b = 2p - 1 - r, in eight phases. Forwards of a, then pairs of forwards (a, b); then I
    of b, a pending W and a forward of b; the steady state runs pairs of one micro-batch's
    forward beside another's whole backward (F of a with B of b, F of b with B of a),
    which DualPipe overlaps on two streams and ptc's one-stream runtime runs one after
    the other; then the backwards drain, split into I and W from the middle on, and the
    pending Ws close the step. Each rank holds at most 2p + 1 chunk micro-batches. With
    F = I = W and B = I + W its step leaves p - 1 half-stage units idle, as ZB-V's."""
    a, b = rank, 2 * p - 1 - rank
    actions: list[Action] = []
    made: dict[tuple[int, str], int] = {}  # (stage, F or backward) -> micro-batches so far
    weights: list[Action] = []  # the Ws of the Is run so far, oldest first

    def run(stage: int, kind: str) -> None:
        key = (stage, "F" if kind == "F" else "backward")
        micro = made.get(key, 0)
        made[key] = micro + 1
        actions.append(Action(stage, kind, micro))
        if kind == "I":
            weights.append(Action(stage, "W", micro))

    def weight() -> None:
        if weights:
            actions.append(weights.pop(0))

    later = p - rank - 1  # ranks after this one
    for _ in range(2 * later):
        run(a, "F")
    for _ in range(rank + 1):
        run(a, "F")
        run(b, "F")
    for _ in range(later):
        run(b, "I")
        weight()
        run(b, "F")
    for _ in range(m - 2 * p + rank + 1):  # forward and backward side by side
        run(a, "F")
        run(b, "B")
        run(b, "F")
        run(a, "B")
    for _ in range(later):
        run(b, "B")
        run(b, "F")
        run(a, "B")
    split = False
    for i in range(rank + 1):  # split backwards from the middle on: Ws fill what is left
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        run(b, "I" if split else "B")
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        run(a, "I" if split else "B")
    for _ in range(later):
        weight()
        run(a, "I" if split else "B")
    while weights:
        weight()
    return tuple(actions)


def _arrived(action: Action, stages: int, done_at: dict[tuple[str, int, int], int],
             step: int) -> bool:
    """Whether what `action` reads was made before `step` (F: the previous stage's F of
    its micro-batch; I: the next stage's I, or on the last stage its own F)."""
    source = {"F": ("F", action.stage - 1), "I": ("I", action.stage + 1)}.get(action.kind)
    if action.kind == "I" and action.stage == stages - 1:
        source = ("F", action.stage)
    if source is None or not 0 <= source[1] < stages:
        return True
    return done_at.get((source[0], source[1], action.microbatch), step) < step


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
