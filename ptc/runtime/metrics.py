"""Rank 0's report of every step: a line, a progress bar on a terminal, a JSONL record.

A line every `runtime.log_every` steps: step, loss, learning rate, gradient
norm, step time, tokens/s, and the cost model's predicted step time when
there is one. On a terminal a rich progress bar runs below the lines. With
`runtime.metrics` set, every step appends one JSON object to that file:
the keys of the line, `predicted_step_time` (null when unknown), `mfu`
(model FLOPs — forward and backward of the whole global batch, no
recompute — per second per GPU over the hardware's dense peak for the
plan's dtype; null when the graphs carry no FLOP counts), `exposed_comm_s`
(seconds rank 0 was blocked waiting for collectives: communication that
computation did not hide), rank 0's
`peak_memory_bytes` (CUDA's peak allocation, or the process's peak RSS on
CPUs), `nonfinite` (ranks that saw a NaN or Inf; the step then updated
nothing, and non-finite values are written as null), `restart` (the
elastic launcher's restart count), `time` (when rank 0 reported the step,
seconds since the epoch: the wall time between two records is a step with
everything around it, checkpoint and snapshot pauses included), and the
step's work skew: `slowest_rank`
and `work_skew`, the largest rank's work (seconds not waiting for
collectives) over the median rank's; under expert parallelism
`expert_tokens_min`, `_mean` and `_max`, the rows one expert received in
one layer's dispatch of one micro-batch (rank 0's ep group's tokens), and
`expert_imbalance`, the rows the busiest ep rank received over the mean
(averaged over the step's dispatches: what `moe.imbalance` prices); with
`moe.capacity_factor`, `expert_rows_dropped`, the routed rows rank 0 dropped
over the experts' capacity in the step. The run's closing lines name the
ranks whose median work per step exceeds the median rank's by more than
`STRAGGLER_SHARE` (stragglers: a slow GPU, a throttled node, a busy host). A resumed run appends to the file; a
fresh run keeps an earlier run's file as `NAME.1` (then `.2`, ...) and says
so, so no record is ever lost. With `runtime.tensorboard` set, the same
numbers are TensorBoard scalars (tag = key, x = step) in event files under
that directory, read by TensorBoard's own loader. With `runtime.wandb` set,
they are logged (key, step) to a Weights & Biases run of that project, named
after the plan file and configured with the plan's fields; W&B's environment
(WANDB_MODE, WANDB_DIR, WANDB_API_KEY) decides where the run goes. A run
with a checkpoint_dir records its W&B run id there (`wandb_run_id`), and a
run resumed from one of its checkpoints continues that W&B run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import secrets
import statistics
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ptc.compiler.graph.meta import get_info
from ptc.compiler.records.program import Program
from ptc.errors import PtcError
from ptc.plan import Plan
from ptc.runtime.executor import StepStats
from ptc.units import format_bytes, format_seconds


def model_flops_per_step(program: Program) -> float | None:
    """Model FLOPs of one step: 3x the forward of every stage graph, over the global batch."""
    forward = sum(info.flops or 0 for stage in program.stages for node in stage.graph.graph.nodes
                  if (info := get_info(node)) is not None)
    train = program.plan.train
    return 3.0 * forward * train.global_batch / train.micro_batch if forward else None


def peak_memory_bytes() -> int:
    """This process's peak memory: CUDA's peak allocation when it computes on a GPU, else RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no NaN


SCALARS = ("loss", "lr", "grad_norm", "step_time", "tokens_per_s", "mfu", "peak_memory_bytes",
           "exposed_comm_s", "predicted_step_time", "work_skew")
"""The record's keys that TensorBoard and W&B plot, each a scalar tag."""


def keep_earlier(path: Path) -> Path | None:
    """Move a non-empty file at `path` to the first free `path.N`; return where it went."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    kept = path.with_name(f"{path.name}.{n}")
    path.rename(kept)
    return kept


def tensorboard_writer(log_dir: str):
    """A TensorBoard `SummaryWriter` on `log_dir`; PtcError naming the plan field when the
    tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - optional
    except ImportError as exc:
        raise PtcError(f"runtime.tensorboard = \"{log_dir}\" needs the tensorboard package "
                       f"({exc}); pip install tensorboard, or remove the field") from None
    return SummaryWriter(log_dir=log_dir)


WANDB_RUN_ID = "wandb_run_id"
"""The file in checkpoint_dir that names the W&B run a resumed run continues."""


def wandb_run(plan: Plan, *, resumed: bool):
    """A W&B run of project `runtime.wandb` with the plan as its config; PtcError naming the
    plan field when the wandb package is missing. `resumed`: the training resumed from a
    checkpoint, so the W&B run recorded beside it continues (`resume="allow"`)."""
    try:
        import wandb  # noqa: PLC0415 - optional, and seconds to import
    except ImportError as exc:
        raise PtcError(f"runtime.wandb = \"{plan.runtime.wandb}\" needs the wandb package "
                       f"({exc}); pip install wandb, or remove the field") from None
    return wandb.init(project=plan.runtime.wandb, name=wandb_run_name(plan),
                      id=wandb_run_id(plan.runtime.checkpoint_dir, resumed=resumed),
                      resume="allow", config=plan_config(plan))


def wandb_run_name(plan: Plan) -> str | None:
    """The W&B run's name: the plan file's stem, else the checkpoint folder's name; None (W&B
    picks one) for a plan built in Python without checkpoints."""
    if not plan.source.startswith("<"):  # "<python>", "<string>": no file
        return Path(plan.source).stem
    return Path(plan.runtime.checkpoint_dir).name if plan.runtime.checkpoint_dir else None


def wandb_run_id(checkpoint_dir: str | None, *, resumed: bool) -> str | None:
    """The W&B run's id: on a resume, the one recorded in `checkpoint_dir`, so the steps append
    to the run that wrote the checkpoint; else a new id, recorded there for the next resume.
    None (W&B picks one) without a checkpoint_dir, since such a run never resumes."""
    if not checkpoint_dir:
        return None
    path = Path(checkpoint_dir) / WANDB_RUN_ID
    if resumed and path.is_file():
        return path.read_text().strip()
    run_id = secrets.token_hex(8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    return run_id


def plan_config(value: object) -> object:
    """`value` (a plan, a section or a field's value) as plain dicts, lists and scalars: the
    W&B config, in which runs compare field by field. Only fields that make plans equal are
    kept (not where they were written, nor the source file)."""
    if dataclasses.is_dataclass(value):
        return {f.name: plan_config(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.compare}
    if isinstance(value, Mapping):
        return {str(k): plan_config(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [plan_config(v) for v in value]
    return value


def run_banner(program: Program) -> str:
    """The run's first line: the model, the layout, and what the cost model predicts."""
    plan = program.plan
    spec, p = plan.model, plan.parallel
    if program.model is not None:
        model = type(program.model).__name__
    elif spec.family == "custom":
        model = spec.factory
    else:
        model = f"{spec.family} {spec.layers} layers, hidden {spec.hidden}"
    layout = f"tp{p.tp}" + (f" cp{p.cp}" if p.cp != 1 else "") + \
        f" pp{p.pp} dp{p.dp}" + (f" ep{p.ep}" if p.ep != 1 else "") + \
        f" zero{p.zero}" + (" sp" if p.sequence_parallel else "")
    est = program.decisions.estimate
    predicted = (f"predicted {format_bytes(est.peak_memory_bytes)} peak of "
                 f"{format_bytes(est.budget_bytes)}, {format_seconds(est.step_time_s)} per step"
                 if est is not None else program.decisions.unpriced or "no prediction")
    if est is not None and plan.hardware.profile:
        predicted += f" (rates from {plan.hardware.profile})"
    elif est is not None and plan.hardware.synchronous:  # a CPU preset guesses at some CPU
        predicted += " (the cpu preset's rates, a guess: ptc calibrate measures this machine's)"
    return (f"ptc run: {model} on {plan.num_gpus} x {plan.hardware.gpu}, {layout}, "
            f"{plan.train.dtype}; {predicted}{_crowded(plan)}")


def _crowded(plan) -> str:
    """What the banner adds when a CPU job's ranks outnumber this machine's cores: they take
    turns on them, so steps take longer than with a core per rank (a calibration made with
    the plan's own processes measures the rates as shared)."""
    cores = os.cpu_count() or 1
    ranks = plan.num_gpus // plan.hardware.nodes
    if not plan.hardware.synchronous or ranks <= cores:
        return ""
    return (f"; {ranks} ranks share this machine's {cores} core{'s' if cores > 1 else ''} "
            f"and take turns on them")


def run_summary(steps: list[StepStats], predicted: float | None) -> str:
    """The run's last line: steps, loss from first to last, median step time, peak memory."""
    if not steps:
        return "ptc run: no step ran"
    times = sorted(s.step_time for s in steps)
    median = times[len(times) // 2]
    against = f" (predicted {format_seconds(predicted)})" if predicted is not None else ""
    return (f"ptc run: {len(steps)} steps, loss from {steps[0].loss:.4f} to "
            f"{steps[-1].loss:.4f}, median step {format_seconds(median)}{against}, rank 0 peak memory "
            f"{format_bytes(peak_memory_bytes())}")


STRAGGLER_SHARE = 0.25
"""A rank whose median work per step exceeds the median rank's by more than this share is
named a straggler..."""
STRAGGLER_FLOOR_S = 0.005
"""...and by more than this many seconds: a millisecond's jitter of short steps is not."""


def stragglers(steps: list[StepStats]) -> str:
    """The line naming the ranks slower than the median rank (`STRAGGLER_SHARE`), from each
    rank's median work per step; "" when none is, or the work was not gathered."""
    rows = [s.rank_work for s in steps if s.rank_work]
    if not rows:
        return ""
    per_rank = [statistics.median(list(column)) for column in zip(*rows)]
    typical = statistics.median(per_rank)
    slow = [(rank, work) for rank, work in enumerate(per_rank)
            if work > typical * (1 + STRAGGLER_SHARE) and work - typical > STRAGGLER_FLOOR_S]
    if not slow:
        return ""
    names = ", ".join(f"rank {rank} {format_seconds(work)} (+{work / typical - 1:.0%})"
                      for rank, work in slow)
    return (f"ptc run: slower than the median rank's {format_seconds(typical)} of work per "
            f"step (time not waiting for collectives): {names}")


def format_step(stats: StepStats, steps: int, predicted: float | None) -> str:
    """The one-line report of a step."""
    line = (f"step {stats.step}/{steps}  loss {stats.loss:.4f}  lr {stats.lr:.3g}  "
            f"|g| {stats.grad_norm:.3g}  {stats.step_time * 1e3:.1f} ms  "
            f"{stats.tokens_per_s:,.0f} tok/s")
    if predicted is not None:
        line += f"  (predicted {predicted * 1e3:.1f} ms)"
    return line


def _skew(work: tuple[float, ...]) -> dict:
    """The record's `slowest_rank` and `work_skew` (None when the work was not gathered)."""
    if not work:
        return {"slowest_rank": None, "work_skew": None}
    typical = statistics.median(list(work))
    slowest = max(range(len(work)), key=work.__getitem__)
    return {"slowest_rank": slowest,
            "work_skew": work[slowest] / typical if typical > 0 else None}


def _expert_tokens(spread: tuple[float, ...]) -> dict:
    """The record's `expert_tokens_min`, `_mean` and `_max` (none without routed experts)."""
    if not spread:
        return {}
    return dict(zip(("expert_tokens_min", "expert_tokens_mean", "expert_tokens_max"), spread))


class StepReporter(AbstractContextManager):
    """Prints and records steps on rank 0; does nothing on other ranks."""

    def __init__(self, plan: Plan, *, steps: int, enabled: bool,
                 predicted_step_time: float | None = None, console: Console | None = None,
                 flops_per_step: float | None = None, append: bool = False,
                 banner: str | None = None):
        """`flops_per_step`: model FLOPs of a step (for MFU); `append`: the run resumed, so
        continue the JSONL file and the W&B run; `banner`: the first line to print
        (`run_banner`); a summary (`run_summary`) closes a run that ends without an error."""
        self.plan, self.steps, self.enabled = plan, steps, enabled
        self.predicted = predicted_step_time
        self.flops, self.append = flops_per_step, append
        p = plan.parallel
        self._peak = p.tp * p.cp * p.pp * p.dp * plan.hardware.peak_flops[plan.train.compute_dtype]
        self.console = console or Console(highlight=False, soft_wrap=True)
        self._progress: Progress | None = None
        self._task = None
        self._file: IO[str] | None = None
        self._board = None
        self._wandb = None
        self.banner = banner
        self._steps: list[StepStats] = []

    def __enter__(self) -> StepReporter:
        if not self.enabled:
            return self
        if self.banner:
            self.console.print(self.banner, markup=False)
        if self.plan.runtime.metrics:
            path = Path(self.plan.runtime.metrics)
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = None if self.append else keep_earlier(path)
            if kept is not None:
                self.console.print(f"metrics: {path} holds an earlier run's steps; kept as "
                                   f"{kept}", markup=False)
            self._file = path.open("a")
        if self.plan.runtime.tensorboard:
            self._board = tensorboard_writer(self.plan.runtime.tensorboard)
        if self.plan.runtime.wandb:
            self._wandb = wandb_run(self.plan, resumed=self.append)
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
        self._steps.append(stats)
        if stats.step % self.plan.runtime.log_every == 0 or stats.step == self.steps:
            console = self._progress.console if self._progress else self.console
            console.print(format_step(stats, self.steps, self.predicted), markup=False)
        if self._progress is not None:
            self._progress.update(self._task, completed=stats.step)
        if self._file is not None or self._board is not None or self._wandb is not None:
            self._record(self._metrics(stats), stats.step)

    def _metrics(self, stats: StepStats) -> dict:
        """The step's record: the module docstring's keys."""
        mfu = self.flops / stats.step_time / self._peak if self.flops and stats.step_time \
            else None
        return {"step": stats.step, "loss": _finite(stats.loss), "lr": stats.lr,
                "grad_norm": _finite(stats.grad_norm), "step_time": stats.step_time,
                "exposed_comm_s": stats.comm_wait, "tokens_per_s": stats.tokens_per_s,
                "predicted_step_time": self.predicted, "mfu": mfu,
                "peak_memory_bytes": peak_memory_bytes(), "nonfinite": list(stats.nonfinite),
                "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                "time": time.time(),
                **_skew(stats.rank_work), **_expert_tokens(stats.expert_tokens),
                **({} if stats.expert_imbalance is None
                   else {"expert_imbalance": stats.expert_imbalance}),
                **({} if stats.expert_dropped is None
                   else {"expert_rows_dropped": stats.expert_dropped})}

    def _record(self, record: dict, step: int) -> None:
        """Append the record to the JSONL file and plot its numbers in TensorBoard and W&B."""
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._board is not None:
            for key in SCALARS:
                if record[key] is not None:
                    self._board.add_scalar(key, record[key], global_step=step)
            self._board.flush()
        if self._wandb is not None:
            self._wandb.log({key: record[key] for key in SCALARS if record[key] is not None},
                            step=step)

    def __exit__(self, kind, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self.enabled and kind is None:
            self.console.print(run_summary(self._steps, self.predicted), markup=False)
            slow = stragglers(self._steps)
            if slow:
                self.console.print(slow, markup=False)
        if self._file is not None:
            self._file.close()
        if self._board is not None:
            self._board.close()
        if self._wandb is not None:
            self._wandb.finish(exit_code=0 if kind is None else 1)  # 1: W&B marks it failed
