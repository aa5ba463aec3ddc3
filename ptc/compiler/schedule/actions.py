"""The pipeline schedule IR: per-rank action lists, generated, lowered, simulated, printed.

Terms. p pipeline ranks, v model chunks per rank (virtual stages), m
micro-batches per step. A *stage* is one of the p·v stage graphs; stage s
lives on rank s % p (Megatron's interleaving: rank r holds stages r, r + p,
...), or, under a V-shaped schedule (zbv), rank r holds stages r and
2p - 1 - r (`ptc.plan.stage_rank`): there stages p - 1 and p share a rank, and
the one hands its values to the other without a message. An *action* is
"stage s does kind k for micro-batch i" and prints as `{s}{k}{i}` — "1F0",
"2B3", "1RECV_F0" — as torch.distributed.pipelining prints its actions;
`Action.parse` reads that text back.

Kinds: `F` (forward), `B` (backward: input and weight gradients), or `B` split
in two, as zero-bubble schedules run it: `I` (the gradients of the stage's inputs,
what the previous stage waits for) then `W` (the gradients of its weights, which
nothing waits for); and the
point-to-point kinds a schedule is lowered to: `RECV_F` (post the receive of
stage s's input activations), `SEND_F` (send stage s's outputs to stage
s + 1), `RECV_B` (post the receive of the gradient of stage s's outputs),
`SEND_B` (send the gradient of stage s's inputs to stage s - 1).

A `Schedule` holds each rank's compute actions (F, B, I, W) in execution order.
`per_rank_actions` adds the communication: a send right after the compute that made
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
from dataclasses import dataclass

from ptc.errors import CompileError
from ptc.plan import stage_rank

COMPUTE = ("F", "B", "I", "W")
"""Kinds that run a stage graph."""
COMM = ("RECV_F", "SEND_F", "RECV_B", "SEND_B")
"""Kinds that move a stage's boundary values between ranks."""
KINDS = COMPUTE + COMM
BACKWARD_DONE = ("B", "W")
"""Kinds after which a micro-batch's activations on a stage are no longer needed."""

# Longest kinds first, so "SEND_F" is not read as a stage number followed by "S...".
_ACTION = re.compile(r"^(\d+)(RECV_F|SEND_F|RECV_B|SEND_B|F|B|I|W)(\d+)$")
HEADER = re.compile(r"^schedule (\S+) pp=(\d+) v=(\d+) m=(\d+)$")


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
    """One of `ptc.plan.SCHEDULES`, or "custom" for a parsed hand-written one."""
    pp: int
    """Pipeline ranks p."""
    virtual: int
    """Stages per rank v."""
    microbatches: int
    """Micro-batches per step m."""
    ranks: tuple[tuple[Action, ...], ...]
    """Per rank, its compute actions (F, B, I, W) in order."""

    @property
    def num_stages(self) -> int:
        """p·v."""
        return self.pp * self.virtual

    def rank_of(self, stage: int) -> int:
        """The rank holding `stage` (`ptc.plan.stage_rank`)."""
        return stage_rank(stage, self.pp, self.kind)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages `rank` holds, chunk 0 first."""
        return tuple(s for s in range(self.num_stages) if self.rank_of(s) == rank)

    def __str__(self) -> str:
        return format_schedule(self)


# ---------------------------------------------------------------- text forms


def format_schedule(schedule: Schedule) -> str:
    """The schedule as text that `parse_schedule` reads back: a header, then one line per rank."""
    lines = [f"schedule {schedule.kind} pp={schedule.pp} v={schedule.virtual} "
             f"m={schedule.microbatches}"]
    lines += [f"rank {r}: " + " ".join(map(str, actions))
              for r, actions in enumerate(schedule.ranks)]
    return "\n".join(lines) + "\n"
