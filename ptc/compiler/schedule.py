"""The pipeline schedule IR: per-rank action lists, generated, lowered, simulated, printed.

Terms. p pipeline ranks, v model chunks per rank (virtual stages), m
micro-batches per step. A *stage* is one of the p·v stage graphs; stage s
lives on rank s % p (Megatron's interleaving: rank r holds stages r, r + p,
...). An *action* is "stage s does kind k for micro-batch i" and prints as
`{s}{k}{i}` — "1F0", "2B3", "1RECV_F0" — as torch.distributed.pipelining
prints its actions; `Action.parse` reads that text back.

Kinds: `F` (forward), `B` (backward: input and weight gradients), and the
point-to-point kinds a schedule is lowered to: `RECV_F` (post the receive of
stage s's input activations), `SEND_F` (send stage s's outputs to stage
s + 1), `RECV_B` (post the receive of the gradient of stage s's outputs),
`SEND_B` (send the gradient of stage s's inputs to stage s - 1).

A `Schedule` holds each rank's compute actions (F, B) in execution order.
`lower` adds the communication: a send right after the compute that made
its data, and each receive posted one compute action before the one that
needs it (so the transfer overlaps that compute) and, per directed pair of
ranks, in the order the peer sends — messages between two ranks are matched
first-posted to first-posted (NCCL's rule; gloo does the same for one tag).

`simulate` runs the lowered programs in lockstep with unit-time compute: a
compute action runs once its input was sent in an earlier step; sends never
block. It fails when no rank can move (deadlock), naming what each rank
waits for, and when two ranks would match a message to the wrong receive.
Its timeline is the step × rank grid `format_grid` prints, and gives each
rank's peak number of in-flight (forwarded, not yet backwarded) stage
micro-batches — what the memory model charges activations for.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ptc.errors import CompileError

COMPUTE = ("F", "B")
"""Kinds that run a stage graph."""
COMM = ("RECV_F", "SEND_F", "RECV_B", "SEND_B")
"""Kinds that move a stage's boundary values between ranks."""
KINDS = COMPUTE + COMM
SCHEDULE_KINDS = ("gpipe", "1f1b", "interleaved")

# Longest kinds first, so "SEND_F" is not read as a stage number followed by "S...".
_ACTION = re.compile(r"^(\d+)(RECV_F|SEND_F|RECV_B|SEND_B|F|B)(\d+)$")
_HEADER = re.compile(r"^schedule (\S+) pp=(\d+) v=(\d+) m=(\d+)$")


class ScheduleError(CompileError):
    """A schedule that cannot run: malformed, too few micro-batches, or deadlocking."""


@dataclass(frozen=True, slots=True)
class Action:
    """Stage `stage` does `kind` for micro-batch `microbatch`; prints as "1F0"."""

    stage: int
    """Stage index, 0 .. p·v - 1."""
    kind: str
    """One of `KINDS`."""
    microbatch: int
    """Micro-batch index, 0 .. m - 1."""

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action printed as `text` ("1F0", "0SEND_B2"); ScheduleError if it is not one."""
        match = _ACTION.match(text.strip())
        if match is None:
            raise ScheduleError(f"{text!r} is not an action: expected stage, kind, micro-batch "
                                f"as in \"1F0\" or \"2RECV_B3\" (kinds: {', '.join(KINDS)})")
        return cls(int(match[1]), match[2], int(match[3]))


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """Each pipeline rank's compute actions for one optimizer step, in execution order."""

    kind: str
    """"gpipe", "1f1b", "interleaved", or "custom" for a parsed hand-written one."""
    pp: int
    """Pipeline ranks p."""
    virtual: int
    """Stages per rank v."""
    microbatches: int
    """Micro-batches per step m."""
    ranks: tuple[tuple[Action, ...], ...]
    """Per rank, its F and B actions in order."""

    @property
    def num_stages(self) -> int:
        """p·v."""
        return self.pp * self.virtual

    def rank_of(self, stage: int) -> int:
        """The rank holding `stage`."""
        return stage % self.pp

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages `rank` holds, chunk 0 first."""
        return tuple(range(rank, self.num_stages, self.pp))

    def __str__(self) -> str:
        return format_schedule(self)


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


# ------------------------------------------------------------------- lowering


def _sent(action: Action, stages: int) -> tuple[Action, int] | None:
    """(the send, destination stage) that compute `action` is followed by, if any."""
    if action.kind == "F" and action.stage < stages - 1:
        return Action(action.stage, "SEND_F", action.microbatch), action.stage + 1
    if action.kind == "B" and action.stage > 0:
        return Action(action.stage, "SEND_B", action.microbatch), action.stage - 1
    return None


def needed_receive(action: Action, stages: int) -> tuple[Action, int] | None:
    """(the receive, source stage) that compute `action` waits for, if any."""
    if action.kind == "F" and action.stage > 0:
        return Action(action.stage, "RECV_F", action.microbatch), action.stage - 1
    if action.kind == "B" and action.stage < stages - 1:
        return Action(action.stage, "RECV_B", action.microbatch), action.stage + 1
    return None


def matching_send(recv: Action) -> Action:
    """The send that delivers receive `recv` ("1RECV_F0" <- "0SEND_F0")."""
    if recv.kind == "RECV_F":
        return Action(recv.stage - 1, "SEND_F", recv.microbatch)
    if recv.kind == "RECV_B":
        return Action(recv.stage + 1, "SEND_B", recv.microbatch)
    raise ScheduleError(f"{recv} is not a receive")


def _message(action: Action) -> tuple[str, int, int]:
    """A message's identity, the same for its send and its receive: (kind, to-stage, micro)."""
    if action.kind == "SEND_F":
        return "act", action.stage + 1, action.microbatch
    if action.kind == "SEND_B":
        return "grad", action.stage - 1, action.microbatch
    return ("act" if action.kind == "RECV_F" else "grad"), action.stage, action.microbatch


def lower(schedule: Schedule) -> tuple[tuple[Action, ...], ...]:
    """Each rank's full program: its compute actions with the sends and receives added.

    See the module docstring for where sends and receives go.
    """
    n = schedule.num_stages
    # Per directed pair (src, dst): the receives dst must post, in src's send order.
    arrivals: dict[tuple[int, int], list[Action]] = {}
    for src, actions in enumerate(schedule.ranks):
        for action in actions:
            sent = _sent(action, n)
            if sent is not None and schedule.rank_of(sent[1]) != src:
                recv = needed_receive(Action(sent[1], action.kind, action.microbatch), n)
                arrivals.setdefault((src, schedule.rank_of(sent[1])), []).append(recv[0])
    position = {recv: i for queue in arrivals.values() for i, recv in enumerate(queue)}
    programs = []
    for rank, actions in enumerate(schedule.ranks):
        posted: dict[int, int] = {}  # source rank -> receives posted so far
        program: list[Action] = []

        def post(action: Action) -> None:
            needed = needed_receive(action, n)
            if needed is None or schedule.rank_of(needed[1]) == rank:
                return
            src = schedule.rank_of(needed[1])
            queue = arrivals.get((src, rank), [])
            if needed[0] not in position:
                raise ScheduleError(f"rank {rank} needs {needed[0]} but rank {src} never sends "
                                    f"{matching_send(needed[0])}")
            upto = position[needed[0]] + 1
            program.extend(queue[posted.get(src, 0):upto])
            posted[src] = max(posted.get(src, 0), upto)

        for index, action in enumerate(actions):
            for ahead in actions[index:index + 2]:
                post(ahead)
            program.append(action)
            sent = _sent(action, n)
            if sent is not None and schedule.rank_of(sent[1]) != rank:
                program.append(sent[0])
        programs.append(tuple(program))
    return tuple(programs)


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


def check(schedule: Schedule) -> None:
    """Raise ScheduleError unless each stage runs F then B of each micro-batch once on its rank."""
    n, m = schedule.num_stages, schedule.microbatches
    if len(schedule.ranks) != schedule.pp:
        raise ScheduleError(f"the schedule lists {len(schedule.ranks)} ranks for "
                            f"pp = {schedule.pp}")
    for rank, actions in enumerate(schedule.ranks):
        done: set[tuple[str, int, int]] = set()
        for action in actions:
            if action.kind not in COMPUTE:
                raise ScheduleError(f"rank {rank}: {action} is a {action.kind}; a schedule lists "
                                    f"only F and B (lower() adds the sends and receives)")
            if not (0 <= action.stage < n and 0 <= action.microbatch < m):
                raise ScheduleError(f"rank {rank}: {action} is outside stages 0..{n - 1}, "
                                    f"micro-batches 0..{m - 1}")
            if schedule.rank_of(action.stage) != rank:
                raise ScheduleError(f"rank {rank}: {action} belongs to rank "
                                    f"{schedule.rank_of(action.stage)} "
                                    f"(stage s runs on rank s % pp)")
            key = (action.kind, action.stage, action.microbatch)
            if key in done:
                raise ScheduleError(f"rank {rank}: {action} appears twice")
            if action.kind == "B" and ("F", action.stage, action.microbatch) not in done:
                raise ScheduleError(f"rank {rank}: {action} comes before "
                                    f"{Action(action.stage, 'F', action.microbatch)}")
            done.add(key)
        missing = [str(Action(s, k, i)) for s in schedule.stages_of(rank) for k in COMPUTE
                   for i in range(m) if (k, s, i) not in done]
        if missing:
            raise ScheduleError(f"rank {rank} never runs {', '.join(missing[:6])}"
                                + (" ..." if len(missing) > 6 else ""))


def _check_pairs(programs: tuple[tuple[Action, ...], ...], schedule: Schedule) -> None:
    """Each directed pair's receives are posted in the order the peer sends (FIFO matching)."""
    sends: dict[tuple[int, int], list[Action]] = {}
    recvs: dict[tuple[int, int], list[Action]] = {}
    n = schedule.num_stages
    for rank, program in enumerate(programs):
        for action in program:
            if action.kind in ("SEND_F", "SEND_B"):
                to = action.stage + (1 if action.kind == "SEND_F" else -1)
                sends.setdefault((rank, schedule.rank_of(to)), []).append(action)
            elif action.kind in ("RECV_F", "RECV_B"):
                source = matching_send(action).stage
                if not 0 <= source < n:
                    raise ScheduleError(f"rank {rank}: {action} receives from no stage")
                recvs.setdefault((schedule.rank_of(source), rank), []).append(action)
    for pair in sorted(set(sends) | set(recvs)):
        sent = [_message(a) for a in sends.get(pair, [])]
        got = [_message(a) for a in recvs.get(pair, [])]
        if sent != got:
            first = next((i for i, (x, y) in enumerate(zip(sent, got)) if x != y),
                         min(len(sent), len(got)))
            src, dst = pair
            theirs = sends.get(pair, [])[first:first + 1]
            ours = recvs.get(pair, [])[first:first + 1]
            raise ScheduleError(
                f"rank {src} -> rank {dst}: message {first} is {theirs[0] if theirs else 'none'} "
                f"on the sender but {ours[0] if ours else 'none'} on the receiver; messages are "
                f"matched in posting order, so the receiver would get the wrong tensor")


def simulate(schedule: Schedule) -> Timeline:
    """Run the lowered schedule in lockstep; ScheduleError if it is malformed or deadlocks."""
    check(schedule)
    programs = lower(schedule)
    _check_pairs(programs, schedule)
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
            in_flight[r] += 1 if action.kind == "F" else -1
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


# ---------------------------------------------------------------- text forms


def format_schedule(schedule: Schedule) -> str:
    """The schedule as text that `parse_schedule` reads back: a header, then one line per rank."""
    lines = [f"schedule {schedule.kind} pp={schedule.pp} v={schedule.virtual} "
             f"m={schedule.microbatches}"]
    lines += [f"rank {r}: " + " ".join(map(str, actions))
              for r, actions in enumerate(schedule.ranks)]
    return "\n".join(lines) + "\n"


def parse_schedule(text: str) -> Schedule:
    """Read `format_schedule`'s text (a hand-written schedule too); check it by simulation."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    header = _HEADER.match(lines[0]) if lines else None
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
