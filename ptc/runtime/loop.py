"""The production training loop: resume, steps, the non-finite policy, checkpoints, hangs.

`TrainLoop(trainer, steps)` sets up, collectively:

- resume: with `runtime.checkpoint_dir`, rank 0 removes partial saves, and
  the newest intact checkpoint is loaded — resharded when the layout
  changed — so training continues at its step and data position. Which
  checkpoint was loaded, or that the run starts fresh, is always said, and
  so is a learning-rate schedule that differs from the checkpoint's.
- with `nan_policy = rollback` and nothing to resume, a checkpoint of the
  initial state (step 0), so that there always is one to roll back to.

`run(report)` then trains up to `steps`. Each step's data starts at the
*position* (next sample index), which is step · global_batch until a
rollback skips data. When any rank saw a NaN or Inf the trainer applied no
update and every rank has the same `StepStats.nonfinite`, so all take the
same action under `runtime.nan_policy`:

- stop: wait for the save in flight, then fail naming the step and ranks;
- skip: the step and its batch count as done, without an update;
- rollback: reload the newest checkpoint and continue from its step with
  the data just past the bad batch (the batches in between are skipped:
  PaLM's recipe for loss spikes — restart before the spike, skip the data
  around it). More than `MAX_ROLLBACKS` rollbacks to one checkpoint stop the
  run: the instability is not in the data.

Python's cyclic garbage is collected every `gc_every` steps, at the same step on every
rank, with the automatic collector off in between (`scheduled_collection`).

Checkpoints are taken every `checkpoint_every` steps and/or
`checkpoint_interval` seconds (rank 0's clock, broadcast so that all ranks
save at the same step), and after the last step; `checkpoint_every = auto`
saves after the first step, then every Young/Daly interval for the pause
that save cost and the job's MTBF (`ptc.compiler.cost.goodput`). A collective that times
out is reported with the ranks that did not answer (`health`); a step that
takes far longer than the steps before it is a stall, noticed within seconds
and reported with the rank that stalled it (`watchdog`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from collections.abc import Callable
from datetime import datetime, timezone

import torch
import torch.distributed as dist

from ptc.compiler.collector import collector_off
from ptc.compiler.cost.goodput import checkpoint_interval, job_mtbf
from ptc.errors import PtcError
from ptc.plan import AUTO
from ptc.runtime import faults
from ptc.runtime.checkpoint import Checkpointer, checkpoint_group
from ptc.runtime.checkpoint_store import CheckpointStore, step_name
from ptc.runtime.executor import RankError, StepStats, doing
from ptc.runtime.export import model_record
from ptc.runtime.health import diagnose_timeout, is_timeout
from ptc.runtime.lr import learning_rate, schedule_change, schedule_record
from ptc.runtime.mesh import timeout
from ptc.runtime.snapshot import MemorySnapshots, room_for_snapshots, snapshot_folder
from ptc.runtime.snapshot_room import snapshots_fit
from ptc.runtime.watchdog import StallWatchdog
from ptc.units import format_bytes, format_duration

MAX_ROLLBACKS = 3
"""Rollbacks to the same checkpoint before the run stops."""
REPORT_GRACE_S = 2.0
"""How long ranks other than 0 wait before failing after a timeout, so that the launcher
shows rank 0's report (which names the missing ranks) as the root cause."""


class TrainLoop:
    """One rank's run of a Trainer: resume, the step loop with its policies, checkpoints."""

    def __init__(self, trainer, steps: int):
        """Set up checkpointing and resume (collective over all ranks)."""
        self.trainer, self.steps = trainer, steps
        self.plan = trainer.plan
        self.rank = dist.get_rank()
        self.events: list[str] = []
        self.step, self.position = 0, 0
        self.resumed_from: int | None = None
        self._rollbacks: dict[int, int] = {}
        self._last_save_time = time.monotonic()
        self._last_saved: int | None = None
        self._save_pause: float | None = None  # what the last save cost training, seconds
        self._interval_said = False
        self.checkpointer = self._checkpointer()
        self._spare = dist.new_group(backend="gloo", timeout=timeout())  # hang diagnosis only
        self.watchdog = _watchdog(self.rank, self.plan.runtime.hang_timeout, trainer)
        self.snapshots = self._snapshots()
        if self.checkpointer is not None:
            self._resume()

    def log(self, message: str) -> None:
        """Report an event (rank 0 prints it; every rank keeps it in `events`)."""
        self.events.append(message)
        if self.rank == 0:
            print(message, flush=True)

    def _checkpointer(self) -> Checkpointer | None:
        rt = self.plan.runtime
        if not rt.checkpoint_dir:
            return None
        store = CheckpointStore(rt.checkpoint_dir)
        if self.rank == 0:
            store.root.mkdir(parents=True, exist_ok=True)
            removed = store.clean()
            if removed:
                self.log(f"removed incomplete checkpoints {', '.join(removed)}")
        return Checkpointer(self.trainer, store, group=checkpoint_group(timeout()),
                            keep=rt.keep, async_save=rt.async_save, log=self.log)

    def _snapshots(self) -> MemorySnapshots | None:
        """The run's in-memory snapshots, or None; `snapshot_every = auto` decided here, the
        same on every rank (collective)."""
        rt = self.plan.runtime
        if rt.snapshot_every is None or not rt.checkpoint_dir:
            return None
        folder, group = snapshot_folder(rt.checkpoint_dir), dist.new_group(
            backend="gloo", timeout=timeout())
        self.snapshot_every = rt.snapshot_every
        if rt.snapshot_every == AUTO:
            need, free = room_for_snapshots(self.trainer, folder)
            fits = torch.tensor([int(snapshots_fit(need, free))])
            dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=group)
            room = (f"{format_bytes(need)} for this node's ranks, their own and a peer's, "
                    f"{format_bytes(free)} free in {folder.parent}")
            if not fits.item():
                self.log(f"in-memory snapshots off (snapshot_every = auto): {room} on some "
                         f"node, and they may take half; restarts resume from storage")
                return None
            self.snapshot_every = 1
            self.log(f"in-memory snapshots every step (snapshot_every = auto): {room}")
        return MemorySnapshots(self.trainer, folder, group, log=self.log)

    def _from_snapshot(self) -> bool:
        """Resume from the newest in-memory snapshot when no storage checkpoint is newer."""
        newest = [self.checkpointer.store.visible()[:1] if self.rank == 0 else None]
        dist.broadcast_object_list(newest, src=0)
        storage = newest[0][0] if newest[0] else None
        restored = self.snapshots.restore(storage)
        if restored is None:
            return False
        self.step, self.position = restored
        self.resumed_from = self.step
        where = "none" if storage is None else step_name(storage)
        self.log(f"resumed from the in-memory snapshot of step {self.step} (the newest "
                 f"checkpoint in storage: {where}): next sample {self.position}")
        return True

    def _resume(self) -> None:
        if self.snapshots is not None and self._from_snapshot():
            return
        manifest = self.checkpointer.restore()
        if manifest is None:
            self.log(f"no checkpoint in {self.plan.runtime.checkpoint_dir}: starting fresh")
            if self.plan.runtime.nan_policy == "rollback":
                self._save()  # the state to roll back to before the first periodic save
            return
        self.step, self.position = manifest.step, manifest.position
        self.resumed_from = self._last_saved = manifest.step
        saved = manifest.info.get("layout", {})
        now = self._layout()
        change = "" if saved == now else f" (resharded from {_fmt(saved)} to {_fmt(now)})"
        self.log(f"resumed from {step_name(manifest.step)}: step {manifest.step}, "
                 f"next sample {manifest.position}{change}")
        change = schedule_change(manifest.info.get("lr_schedule", self._schedule()),
                                 self._schedule(), self.step)
        if change:
            self.log(f"{change}; continuing with the plan's")

    # ------------------------------------------------------------------ running

    def run(self, report: Callable[[StepStats], None]) -> None:
        """Train until `steps` steps are done; `report` gets every step's statistics."""
        batch = self.plan.train.global_batch
        try:
            with scheduled_collection(self.plan.runtime.gc_every) as collect:
                while self.step < self.steps:
                    self.watchdog.started(self.step + 1)
                    faults.at_step_start(self.rank, self.step + 1)
                    stats = self._train_step()
                    report(dataclasses.replace(stats, rank_work=self._rank_work(stats)))
                    if stats.nonfinite:
                        self._nonfinite(stats)
                    else:
                        self.step, self.position = self.step + 1, self.position + batch
                    if self._save_due():
                        self._save()
                    if self.snapshots is not None and \
                            self.step % self.snapshot_every == 0:
                        with self.watchdog.paused():
                            self.snapshots.take(self.step, self.position)
                    collect()
                    self.watchdog.finished()
            if self.checkpointer is not None:
                self.checkpointer.wait()  # the save in flight may have failed: then again
                if self.checkpointer.saved_step != self.step:
                    self._save()
        except BaseException:
            if self.checkpointer is not None:
                # Finish (or fail) the save in flight, but report the error that stopped us.
                with contextlib.suppress(Exception):
                    self.checkpointer.close(failing=True)
            raise
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self.snapshots is not None:  # the run ended well: its snapshots are not needed
            self.snapshots.close(remove=True)

    def _rank_work(self, stats: StepStats) -> tuple[float, ...]:
        """Every rank's work in the step (`StepStats.rank_work`), gathered on every rank."""
        mine = torch.tensor([stats.step_time - stats.comm_wait], dtype=torch.float64,
                            device=self.trainer.device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        return tuple(torch.cat(every).tolist())  # one device sync, not one per rank

    def _train_step(self) -> StepStats:
        try:
            # Both trainers (one stage and pipeline) take the data position. The updated
            # weights' all-gathers stay in flight when the loop's next work is another step.
            return self.trainer.train_step(self.step, position=self.position,
                                           leave_weights=self._steps_on())
        except Exception as exc:
            if not is_timeout(exc):
                raise
            diagnosis = diagnose_timeout(self._spare, timeout())
            if self.rank != 0:
                time.sleep(REPORT_GRACE_S)
            raise RankError(f"rank {self.rank}: step {self.step + 1}: a collective timed out "
                            f"after {timeout().total_seconds():g} s; {diagnosis}") from exc

    def _steps_on(self) -> bool:
        """Whether another step follows the one about to run. What the loop does between
        steps reads no weights: saves and snapshots take the masters and optimizer state,
        a rollback follows a step that updated nothing."""
        return self.step + 1 < self.steps

    def _nonfinite(self, stats: StepStats) -> None:
        policy = self.plan.runtime.nan_policy
        what = f"step {stats.step}: non-finite loss or gradient on rank(s) {list(stats.nonfinite)}"
        if policy == "stop":
            if self.checkpointer is not None:
                self.checkpointer.close()
            raise PtcError(f"{what}; nan_policy = stop")
        batch = self.plan.train.global_batch
        if policy == "skip":
            self.log(f"{what}: step skipped, no update")
            self.step, self.position = self.step + 1, self.position + batch
            return
        bad_position = self.position
        with self.watchdog.paused():
            manifest = self.checkpointer.restore()
        if manifest is None:
            raise PtcError(f"{what}; nan_policy = rollback, but no intact checkpoint is left")
        count = self._rollbacks[manifest.step] = self._rollbacks.get(manifest.step, 0) + 1
        if count > MAX_ROLLBACKS:
            raise PtcError(f"{what}; rolled back to {step_name(manifest.step)} {MAX_ROLLBACKS} "
                           f"times already: the run does not recover by skipping data")
        self.step, self.position = manifest.step, bad_position + batch
        self._last_saved = manifest.step
        self.log(f"{what}: rolled back to {step_name(manifest.step)}; data resumes at sample "
                 f"{self.position} (samples {manifest.position}..{self.position - 1} skipped)")

    # ------------------------------------------------------------- checkpoints

    def _save_due(self) -> bool:
        if self.checkpointer is None:
            return False
        rt = self.plan.runtime
        auto = rt.checkpoint_every == AUTO
        due = not auto and bool(rt.checkpoint_every) and self.step % rt.checkpoint_every == 0
        intervals = [t for t in (rt.checkpoint_interval, self._auto_interval() if auto else None)
                     if t is not None]
        if intervals:
            # Clocks differ: rank 0 decides, so that every rank joins the same save.
            late = torch.tensor(
                [time.monotonic() - self._last_save_time >= min(intervals)],
                dtype=torch.uint8, device=self.trainer.device)
            dist.broadcast(late, src=0)
            due = due or bool(late.item())
        return due and self.step != self._last_saved  # not again right after a rollback to it

    def _auto_interval(self) -> float:
        """checkpoint_every = auto: Young and Daly's interval for the pause the last save
        cost this rank and the job's MTBF (`goodput`); 0 before any save, so that the first
        step's save measures it."""
        if self._save_pause is None:
            return 0.0
        mtbf = job_mtbf(dist.get_world_size(), self.plan.runtime.mtbf)
        interval = checkpoint_interval(self._save_pause, mtbf)
        if not self._interval_said:
            self._interval_said = True
            self.log(f"checkpoint_every = auto: a save pauses training "
                     f"{format_duration(self._save_pause)} and the job's MTBF is "
                     f"{format_duration(mtbf)}, so a save every {format_duration(interval)} "
                     f"(Young/Daly)")
        return interval

    def _save(self) -> None:
        train = self.plan.train
        info = {"layout": self._layout(), "lr_schedule": self._schedule(),
                "next_lr": learning_rate(self.step, train.optimizer.lr, train.lr_schedule,
                                         train.steps),
                "global_batch": train.global_batch,
                "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                # what `ptc export` needs to write the weights under the module's names
                "model": self._model_record(),
                "names": {slot.name: list(slot.aliases)
                          for slot in self.trainer.program.layout.params.values()}}
        started = time.monotonic()
        with self.watchdog.paused():
            saved = self.checkpointer.save(self.step, self.position, info)
        self._save_pause = time.monotonic() - started
        if saved:
            self._last_saved = self.step
        self._last_save_time = time.monotonic()

    def _model_record(self) -> dict | None:
        """The plan's model section, unless a module given to ptc.compile trained instead."""
        program = self.trainer.program
        if program.model is not None and self.plan.model.family != "custom":
            return None
        return model_record(self.plan.model)

    def _schedule(self) -> dict:
        """The learning-rate schedule as the manifest records it (total steps included)."""
        train = self.plan.train
        return schedule_record(train.optimizer.lr, train.lr_schedule, train.steps)

    def _layout(self) -> dict[str, int]:
        p = self.plan.parallel
        # Checkpoints without cp (ep) read as cp 1 (ep 1).
        cp = {"cp": p.cp} if p.cp != 1 else {}
        ep = {"ep": p.ep} if p.ep != 1 else {}
        return {"tp": p.tp, **cp, "pp": p.pp, "dp": p.dp, **ep, "zero": p.zero}


def _watchdog(rank: int, hang_timeout: float | str | None, trainer
              ) -> StallWatchdog | _NoWatchdog:
    """The stall watchdog of a rank of a launched job of several ranks (their launcher
    set MASTER_ADDR, where the job's store is), with `runtime.hang_timeout`'s limit ("auto":
    the steps' own), naming the `trainer`'s action of the moment; else, or with
    hang_timeout = none, one that watches nothing."""
    world = dist.get_world_size()
    if world == 1 or "MASTER_ADDR" not in os.environ or hang_timeout is None:
        return _NoWatchdog()
    return StallWatchdog(rank, world, timeout=None if hang_timeout == AUTO else hang_timeout,
                         doing=lambda: None if trainer.action is None else doing(trainer.action))


class _NoWatchdog:
    """A single process's watchdog: there is nobody to hold up."""

    def started(self, step: int) -> None:  # noqa: D102 - StallWatchdog's
        pass

    def finished(self) -> None:  # noqa: D102
        pass

    @contextlib.contextmanager
    def paused(self):  # noqa: D102
        yield


@contextlib.contextmanager
def scheduled_collection(every: int | None):
    """Within: Python's automatic garbage collector is off and the callable this yields,
    called once after each step, collects every `every`-th call (`runtime.gc_every`): every
    rank takes the same steps, so all collect at the same step, where an automatic collection
    would pause one rank at its own moment and hold up each collective of that step. After,
    the collector is as it was. `every` None: nothing changes, the callable does nothing."""
    if every is None:
        yield lambda: None
        return
    calls = 0

    def collect() -> None:
        nonlocal calls
        calls += 1
        if calls % every == 0:
            gc.collect()

    with collector_off():
        gc.collect()  # what setup left: the steps start from a clean heap
        yield collect


def _fmt(layout: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in layout.items()) or "an unknown layout"
