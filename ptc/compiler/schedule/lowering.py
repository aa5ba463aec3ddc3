"""Lowering a schedule to what each rank runs: its compute actions with the sends and
receives between them, checked deadlock-free (`check`). See `ptc.compiler.schedule.actions`
for the terms."""

from __future__ import annotations

from ptc.compiler.schedule.actions import COMPUTE, Action, Schedule, ScheduleError

# ------------------------------------------------------------------- lowering


def _sent(action: Action, stages: int) -> tuple[Action, int] | None:
    """(the send, destination stage) that compute `action` is followed by, if any."""
    if action.kind == "F" and action.stage < stages - 1:
        return Action(action.stage, "SEND_F", action.microbatch), action.stage + 1
    if action.kind in ("B", "I") and action.stage > 0:
        return Action(action.stage, "SEND_B", action.microbatch), action.stage - 1
    return None


def needed_receive(action: Action, stages: int) -> tuple[Action, int] | None:
    """(the receive, source stage) that compute `action` waits for, if any."""
    if action.kind == "F" and action.stage > 0:
        return Action(action.stage, "RECV_F", action.microbatch), action.stage - 1
    if action.kind in ("B", "I") and action.stage < stages - 1:
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


def per_rank_actions(schedule: Schedule) -> tuple[tuple[Action, ...], ...]:
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
                recv = needed_receive(Action(sent[1], "F" if action.kind == "F" else "B",
                                             action.microbatch), n)
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


def check(schedule: Schedule) -> None:
    """Raise ScheduleError unless each stage runs, of each micro-batch once on its rank, F
    then B, or F then I then W (the backward split)."""
    n, m = schedule.num_stages, schedule.microbatches
    if len(schedule.ranks) != schedule.pp:
        raise ScheduleError(f"the schedule lists {len(schedule.ranks)} ranks for "
                            f"pp = {schedule.pp}")
    for rank, actions in enumerate(schedule.ranks):
        done: set[tuple[str, int, int]] = set()
        for action in actions:
            _check_one(schedule, rank, action, done)
            done.add((action.kind, action.stage, action.microbatch))
        missing = [str(Action(s, k, i)) for s in schedule.stages_of(rank) for i in range(m)
                   for k in _expected_kinds(done, s, i) if (k, s, i) not in done]
        if missing:
            raise ScheduleError(f"rank {rank} never runs {', '.join(missing[:6])}"
                                + (" ..." if len(missing) > 6 else ""))


_BEFORE = {"B": "F", "I": "F", "W": "I"}
"""The action of the same stage and micro-batch each kind comes after."""


def _check_one(schedule: Schedule, rank: int, action: Action,
               done: set[tuple[str, int, int]]) -> None:
    """ScheduleError if `action` cannot come next on `rank` after the actions `done`."""
    n, m = schedule.num_stages, schedule.microbatches
    if action.kind not in COMPUTE:
        raise ScheduleError(f"rank {rank}: {action} is a {action.kind}; a schedule lists "
                            f"only {', '.join(COMPUTE)} (per_rank_actions() adds the sends "
                            f"and receives)")
    if not (0 <= action.stage < n and 0 <= action.microbatch < m):
        raise ScheduleError(f"rank {rank}: {action} is outside stages 0..{n - 1}, "
                            f"micro-batches 0..{m - 1}")
    if schedule.rank_of(action.stage) != rank:
        raise ScheduleError(f"rank {rank}: {action} belongs to rank "
                            f"{schedule.rank_of(action.stage)} (stages of rank {rank}: "
                            f"{', '.join(map(str, schedule.stages_of(rank)))})")
    if (action.kind, action.stage, action.microbatch) in done:
        raise ScheduleError(f"rank {rank}: {action} appears twice")
    before = _BEFORE.get(action.kind)
    if before is not None and (before, action.stage, action.microbatch) not in done:
        raise ScheduleError(f"rank {rank}: {action} comes before "
                            f"{Action(action.stage, before, action.microbatch)}")
    other = Action(action.stage, "I" if action.kind == "B" else "B", action.microbatch)
    if action.kind in ("B", "I") and (other.kind, other.stage, other.microbatch) in done:
        raise ScheduleError(f"rank {rank}: {action} after {other}: a micro-batch's backward "
                            f"is either B, or I then W")


def _expected_kinds(done: set[tuple[str, int, int]], stage: int, micro: int) -> tuple[str, ...]:
    """The kinds stage `stage` must run for `micro`: F, B, or F, I, W once it split."""
    return ("F", "I", "W") if ("I", stage, micro) in done or ("W", stage, micro) in done \
        else ("F", "B")


def check_pairs(programs: tuple[tuple[Action, ...], ...], schedule: Schedule) -> None:
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
