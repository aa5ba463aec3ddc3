"""Rank 0's report of every step: a line, a progress bar on a terminal, a JSONL record.

A line every `runtime.log_every` steps: step, loss, learning rate, gradient
norm, step time, tokens/s, and the cost model's predicted step time when
there is one. On a terminal a rich progress bar runs below the lines. With
`runtime.metrics` set, every step appends one JSON object to that file
(the keys of the line, with `predicted_step_time` null when unknown).
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ptc.plan import Plan
from ptc.runtime.executor import StepStats


def format_step(stats: StepStats, steps: int, predicted: float | None) -> str:
    """The one-line report of a step."""
    line = (f"step {stats.step}/{steps}  loss {stats.loss:.4f}  lr {stats.lr:.3g}  "
            f"|g| {stats.grad_norm:.3g}  {stats.step_time * 1e3:.1f} ms  "
            f"{stats.tokens_per_s:,.0f} tok/s")
    if predicted is not None:
        line += f"  (predicted {predicted * 1e3:.1f} ms)"
    return line


class StepReporter(AbstractContextManager):
    """Prints and records steps on rank 0; does nothing on other ranks."""

    def __init__(self, plan: Plan, *, steps: int, enabled: bool,
                 predicted_step_time: float | None = None, console: Console | None = None):
        self.plan, self.steps, self.enabled = plan, steps, enabled
        self.predicted = predicted_step_time
        self.console = console or Console(highlight=False, soft_wrap=True)
        self._progress: Progress | None = None
        self._task = None
        self._file: IO[str] | None = None

    def __enter__(self) -> StepReporter:
        if not self.enabled:
            return self
        if self.plan.runtime.metrics:
            path = Path(self.plan.runtime.metrics)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("w")
        if self.console.is_terminal:
            self._progress = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                                      TimeRemainingColumn(), console=self.console)
            self._task = self._progress.add_task("steps", total=self.steps)
            self._progress.start()
        return self

    def report(self, stats: StepStats) -> None:
        """Report one finished step."""
        if not self.enabled:
            return
        if stats.step % self.plan.runtime.log_every == 0 or stats.step == self.steps:
            console = self._progress.console if self._progress else self.console
            console.print(format_step(stats, self.steps, self.predicted), markup=False)
        if self._progress is not None:
            self._progress.update(self._task, completed=stats.step)
        if self._file is not None:
            record = {"step": stats.step, "loss": stats.loss, "lr": stats.lr,
                      "grad_norm": stats.grad_norm, "step_time": stats.step_time,
                      "tokens_per_s": stats.tokens_per_s, "predicted_step_time": self.predicted}
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._file is not None:
            self._file.close()
