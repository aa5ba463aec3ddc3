"""Test hook: failures injected at a chosen step of a chosen rank, from `PTC_FAULT`.

`PTC_FAULT` is a comma-separated list of KIND[@PHASE]:RANK:STEP[:ATTEMPT]
(STEP 1-based, as steps are reported; ATTEMPT the launcher's restart count
it fires in, 0 by default, so that a restarted group runs through), for
example `PTC_FAULT=kill:1:3` or `PTC_FAULT=kill@backward:1:5,kill:0:9:1`:

- kill: the rank kills itself (SIGKILL: no cleanup, like a lost machine) at
  PHASE of step STEP (`hang` takes a PHASE too): `start` (the default: as the step starts), `forward`
  (its first forward), `backward` (its first backward), `optimizer` (as the
  optimizer step begins, gradients reduced) or `snapshot` (while it writes
  its in-memory snapshot of step STEP, the file half written).
- wipe: as kill, and the rank's own in-memory snapshot is lost with it (its
  file under `snapshot.snapshot_root()` removed): only its peer's copy is left.
- nan: a NaN is written into the rank's gradient in step STEP, once per
  process (a rolled-back run that reaches STEP again trains normally).
- savefail: the rank's part of the checkpoint of step STEP fails to write,
  as on a full disk.
- hang: the rank sleeps at PHASE of step STEP, until the launcher stops it.
- slow: from step STEP on, the rank sleeps `SLOW_S` in each forward (a
  straggler: a slow GPU, a throttled node).

Unset, every hook does nothing. The fault-injection tests are its only users.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

ENV = "PTC_FAULT"
KINDS = ("kill", "wipe", "nan", "hang", "savefail", "slow")
PHASES = ("start", "forward", "backward", "optimizer", "snapshot")
"""Where in a step a `kill` fires."""
SLOW_S = 0.1
"""What a `slow` rank sleeps in each forward."""
_fired: set[tuple[str, int, int]] = set()


class _Fault(NamedTuple):
    """One item of `PTC_FAULT`."""

    kind: str
    phase: str
    rank: int
    step: int
    attempt: int


@functools.lru_cache(maxsize=4)
def _faults(text: str) -> tuple[_Fault, ...]:
    """`PTC_FAULT`'s items, read once per value (the hooks run in every forward)."""
    faults = []
    for item in filter(None, text.split(",")):
        what, r, s, *when = item.split(":")
        kind, _, phase = what.partition("@")
        if kind not in KINDS or phase not in ("", *PHASES):
            raise ValueError(f"{ENV}: unknown fault {what!r}, known: {', '.join(KINDS)}, "
                             f"kill@PHASE and hang@PHASE for PHASE in {', '.join(PHASES)}")
        faults.append(_Fault(kind, phase or "start", int(r), int(s), int((when or ["0"])[0])))
    return tuple(faults)


def _wanted(kind: str, rank: int, step: int, phase: str = "start") -> bool:
    faults = _faults(os.environ.get(ENV, ""))
    if not faults:
        return False
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return (kind, rank, step) not in _fired and any(
        (f.kind, f.rank, f.step, f.phase) == (kind, rank, step, phase)
        and (kind in ("nan", "savefail") or f.attempt == attempt) for f in faults)


def at_step_start(rank: int, step: int) -> None:
    """Kill or hang this rank if `PTC_FAULT` says so for the start of `step` (1-based)."""
    if _wanted("wipe", rank, step):
        from ptc.runtime.snapshot import snapshot_root  # noqa: PLC0415

        for path in snapshot_root().glob(f"*/rank{rank}.safetensors"):
            path.unlink()
        os.kill(os.getpid(), signal.SIGKILL)
    at_phase("start", rank, step)


def at_phase(phase: str, rank: int, step: int) -> None:
    """Kill or hang this rank if `PTC_FAULT` says so for `phase` of `step` (1-based); slow it
    down in a forward if it is slow by then."""
    if _wanted("kill", rank, step, phase):
        os.kill(os.getpid(), signal.SIGKILL)
    if _wanted("hang", rank, step, phase):
        _fired.add(("hang", rank, step))
        time.sleep(3600)
    if phase == "forward" and _slow(rank, step):
        time.sleep(SLOW_S)


def _slow(rank: int, step: int) -> bool:
    """Whether `PTC_FAULT` makes this rank slow in `step` (a `slow` fault at or before it)."""
    return any(f.kind == "slow" and f.rank == rank and f.step <= step
               for f in _faults(os.environ.get(ENV, "")))


def corrupt_gradients(rank: int, step: int, grads: Sequence[torch.Tensor]) -> None:
    """Write a NaN into this rank's first gradient buffer if `PTC_FAULT` says so for `step`."""
    if grads and _wanted("nan", rank, step):
        _fired.add(("nan", rank, step))
        grads[0].view(-1)[0] = float("nan")


def save_fails(rank: int, step: int) -> bool:
    """Whether this rank's checkpoint write of `step` should fail (`PTC_FAULT` savefail)."""
    if _wanted("savefail", rank, step):
        _fired.add(("savefail", rank, step))
        return True
    return False
