"""Noticing a stalled step within seconds, and naming the rank that stalled it.

A rank that hangs (a deadlocked data loader, a stuck kernel, a lost peer
that is not dead) stops every other rank at its next collective, and the
collective timeout (`PTC_TIMEOUT`, 300 s, NCCL's default 10 min) is sized
for the slowest legitimate wait, not for a step that takes a fraction of a
second. `StallWatchdog` is a thread on every rank that knows how long steps
take: once a step has completed, a step that has not finished within

    limit = max(MIN_STALL_S, STALL_FACTOR × the median step so far)

(10 s for steps under 2 s, 5 × the step beyond) is a stall, with no timeout
set by hand (`runtime.hang_timeout` sets the limit instead, or turns the
watchdog off). Checkpoint saves and restores are not steps: the loop pauses
the watchdog around them.

On a stall each rank says where its main thread is (`main_thread_at`: the
innermost frame in ptc, and whether it waits in a collective) under a key
of the job's store, waits up to `REPORT_GRACE_S` for the others' reports,
and ends the same verdict (`stall_verdict`): the ranks not waiting in a
collective stalled the step; a rank that does not report is hung in native
code or dead; every rank in a collective is a deadlock. Every thread's
stack goes to the rank's log (faulthandler). It records the
verdict as the rank's error for the launcher (torch elastic's error file)
and exits, so the launcher stops the job with that one line, or restarts
the group (`--max-restarts`), which resumes from the latest checkpoint.
"""

from __future__ import annotations

import bisect
import contextlib
import faulthandler
import linecache
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

MIN_STALL_S = 10.0
"""The shortest stall noticed: steps under a second would otherwise be stopped by a pause
of the machine."""
STALL_FACTOR = 5.0
"""A step this many times the median so far is a stall."""
REPORT_GRACE_S = 5.0
"""How long a rank that noticed a stall waits for the others' reports."""
POLL_S = 0.25
"""How often the thread looks at the clock."""
COLLECTIVE_WORDS = ("wait(", "all_reduce", "all_gather", "reduce_scatter", "broadcast",
                    "barrier", "send(", "recv(", "all_to_all")
"""Words of a source line that waits on other ranks."""
_PTC = str(Path(__file__).resolve().parents[1])
_TORCH_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep


def main_thread_at() -> tuple[str, bool]:
    """Where this process's main thread is: the innermost frame in ptc as "file:line in
    function" (the innermost frame at all when none is in ptc), and whether it waits on
    other ranks (a frame in torch.distributed, or a ptc line that waits on a collective)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    innermost, waiting = None, False
    while frame is not None:
        code = frame.f_code
        if _TORCH_DISTRIBUTED in code.co_filename:
            waiting = True
        if code.co_filename.startswith(_PTC) and innermost is None:
            innermost = frame
            line = linecache.getline(code.co_filename, frame.f_lineno)
            waiting = waiting or any(word in line for word in COLLECTIVE_WORDS)
        frame = frame.f_back if innermost is None else None
    if innermost is None:
        return "outside ptc", waiting
    path = os.path.relpath(innermost.f_code.co_filename, Path(_PTC).parent)
    return f"{path}:{innermost.f_lineno} in {innermost.f_code.co_name}", waiting


def stall_verdict(reports: dict[int, tuple[int, str, bool]], world: int, waited: float) -> str:
    """The one line a stall ends the job with. `reports`: per rank that answered, (the step
    it is in, where its main thread is, whether that waits in a collective)."""
    stalled = sorted(r for r, (_, _, waiting) in reports.items() if not waiting)
    silent = sorted(set(range(world)) - set(reports))
    step = max(s for s, _, _ in reports.values())
    parts = []
    if stalled:
        parts.append("; ".join(f"rank {r} stalled in step {reports[r][0]} at {reports[r][1]}"
                               for r in stalled))
    if silent:
        parts.append(f"rank(s) {', '.join(map(str, silent))} did not answer (hung in native "
                     f"code, or dead)")
    waiting = sorted(r for r, (_, _, w) in reports.items() if w)
    if not stalled and not silent:
        parts.append("every rank waits in a collective: a deadlock (the ranks issued "
                     "different collectives)")
    if waiting:
        parts.append(f"rank(s) {', '.join(map(str, waiting))} wait(s) in a collective "
                     f"({reports[waiting[0]][1]})")
    return f"step {step}: no progress for {waited:.0f} s; " + "; ".join(parts)


class StallWatchdog:
    """This rank's stall watchdog (module docstring). `started(step)` and `finished()` mark
    each step; `paused()` brackets what is not a step (a checkpoint save)."""

    def __init__(self, rank: int, world: int, *, timeout: float | None = None,
                 exit_code: int = 1, doing: Callable[[], str | None] = lambda: None):
        """Start the thread; it reports through a client of the job's store
        (MASTER_ADDR:MASTER_PORT, which the launcher set). `timeout`: the limit in seconds
        (`runtime.hang_timeout`), else the steps' own (module docstring); `doing`: what the
        step is doing now, in words (its micro-batch and action), named in the report."""
        self.rank, self.world, self.exit_code, self.doing = rank, world, exit_code, doing
        self.timeout = timeout
        self._store = dist.PrefixStore(
            f"ptc-stall-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
            dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=REPORT_GRACE_S)))
        self._lock = threading.Lock()
        self._step: int | None = None
        self._since = time.monotonic()
        self._times: list[float] = []  # of the completed steps
        self._paused = 0
        threading.Thread(target=self._watch, name="ptc-stall-watchdog", daemon=True).start()

    def started(self, step: int) -> None:
        """Step `step` (1-based) starts now."""
        with self._lock:
            self._step, self._since = step, time.monotonic()

    def finished(self) -> None:
        """The step started last is done: its time counts towards the limit."""
        with self._lock:
            bisect.insort(self._times, time.monotonic() - self._since)
            self._step = None

    @contextlib.contextmanager
    def paused(self):
        """Within: not a step (a checkpoint save or restore): nothing is a stall."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                self._since = time.monotonic()

    def limit(self) -> float | None:
        """Seconds after which the running step is a stall; None before a step completed."""
        if not self._times:
            return None
        if self.timeout is not None:
            return self.timeout
        return max(MIN_STALL_S, STALL_FACTOR * self._times[len(self._times) // 2])

    def _watch(self) -> None:
        while True:
            time.sleep(POLL_S)
            with self._lock:
                limit, step = self.limit(), self._step
                waited = time.monotonic() - self._since
                if step is None or self._paused or limit is None or waited < limit:
                    continue
            self._stop(step, waited)

    def _stop(self, step: int, waited: float) -> None:
        """Report, wait for the others' reports, record the verdict and exit."""
        where, waiting = main_thread_at()
        now = self.doing()
        where = f"{where} ({now})" if now else where
        self._store.set(str(self.rank), f"{step}|{int(waiting)}|{where}")
        deadline = time.monotonic() + REPORT_GRACE_S
        keys = [str(r) for r in range(self.world)]
        while time.monotonic() < deadline and not self._store.check(keys):
            time.sleep(POLL_S)
        reports = {}
        for r in range(self.world):
            if self._store.check([str(r)]):
                s, w, at = self._store.get(str(r)).decode().split("|", 2)
                reports[r] = (int(s), at, w == "1")
        from ptc.runtime.executor import RankError  # noqa: PLC0415

        error = RankError(f"rank {self.rank}: {stall_verdict(reports, self.world, waited)}")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)  # into the rank's log
        _record(error)
        print(f"ptc: {error}", file=sys.stderr, flush=True)
        os._exit(self.exit_code)


def _record(error: BaseException) -> None:
    """Write `error` where the elastic launcher reads a failed rank's error from (its error
    file): the main thread, blocked, cannot raise it."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler  # noqa: PLC0415

    ErrorHandler().record_exception(error)
