"""Test hook: failures injected at a chosen step of a chosen rank, from `PTC_FAULT`.

`PTC_FAULT` is a comma-separated list of KIND:RANK:STEP (STEP 1-based, as
steps are reported), for example `PTC_FAULT=kill:1:3`:

- kill: the rank kills itself (SIGKILL: no cleanup, like a lost machine) as
  step STEP starts — only in the launcher's first attempt
  (TORCHELASTIC_RESTART_COUNT 0), so that the restarted group runs through.
- wipe: as kill, and the rank's own in-memory snapshot is lost with it (its
  file under `snapshot.snapshot_root()` removed): only its peer's copy is left.
- nan: a NaN is written into the rank's gradient in step STEP, once per
  process (a rolled-back run that reaches STEP again trains normally).
- savefail: the rank's part of the checkpoint of step STEP fails to write,
  as on a full disk.
- hang: the rank sleeps as step STEP starts, until the launcher stops it (in
  the first attempt only: a restarted group trains on, as after a kill).

Unset, every hook does nothing. The fault-injection tests are its only users.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence

import torch

ENV = "PTC_FAULT"
KINDS = ("kill", "wipe", "nan", "hang", "savefail")
_fired: set[tuple[str, int, int]] = set()


def _wanted(kind: str, rank: int, step: int) -> bool:
    for item in filter(None, os.environ.get(ENV, "").split(",")):
        k, r, s = item.split(":")
        if k not in KINDS:
            raise ValueError(f"{ENV}: unknown fault {k!r}, known: {', '.join(KINDS)}")
        if (k, int(r), int(s)) == (kind, rank, step) and (kind, rank, step) not in _fired:
            return True
    return False


def at_step_start(rank: int, step: int) -> None:
    """Kill or hang this rank if `PTC_FAULT` says so for `step` (1-based)."""
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if _wanted("wipe", rank, step) and first:
        from ptc.runtime.snapshot import snapshot_root  # noqa: PLC0415

        for path in snapshot_root().glob(f"*/rank{rank}.safetensors"):
            path.unlink()
        os.kill(os.getpid(), signal.SIGKILL)
    if _wanted("kill", rank, step) and first:
        os.kill(os.getpid(), signal.SIGKILL)
    if _wanted("hang", rank, step) and first:
        _fired.add(("hang", rank, step))
        time.sleep(3600)


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
