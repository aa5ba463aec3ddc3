"""Predicted against measured step-time ratios between layouts of the README plan.

The README plan (`examples/tiny_gpt_cpu.ptc`: a 4-layer GPT on 8 local gloo
processes on this CPU) is trained under six layouts of its 8 ranks: dp 8
(the baseline), tp 2 × dp 4, tp 2 with sequence parallelism × dp 4,
pp 2 × dp 4, cp 2 × dp 4 and ZeRO-3 (dp 8, zero 3). For each, the cost
model's predicted step time (`ptc.estimate`, the same estimate the compile
keeps in `Program.decisions.estimate` and `ptc run` prints) is set against
the step time measured by training the plan (`ptc.run`, rank 0's
`StepStats.step_time`): the median over a run's steps after `--warmup`
warm-up steps, then the median (and min–max) of that over `--repeats` runs.
The runs take turns (every layout once, then again), so a burst of other
work on the machine moves one round, not one layout.

Calibration first, as a user would: the preset `cpu` hardware is a guess at
some CPU, so its predictions say little about this one. `ptc calibrate`
measures this machine's GEMM rate, memory-bound rate, per-op dispatch
overhead and link latency and bandwidth in the plan's own 8 processes, and
every layout's plan then names that file (`hardware { profile = ... }`).
`--profile PATH` reuses an earlier calibration instead (of the same plan on
the same machine, or the comparison means little).

What is compared is the ratio of each layout's step time to dp 8's,
predicted and measured: a cost model that is off by a constant factor on
this machine still ranks and sizes layouts rightly, and that is what `ptc
plan` relies on. The last column is the relative difference of the two
ratios, predicted / measured - 1; "within 10 %" means its magnitude is at
most 0.10 (dp 8 itself, 1 against 1, is not counted).

All six layouts are valid for the plan as written: its 4 heads divide by
tp 2, its seq_len 64 by 2·cp = 4 (cp's load-balanced chunks), and its global
batch of 16 splits into micro-batches of 1 over dp 8 or dp 4 (4 per
pipeline, enough for pp 2). Only the steps change (`--steps`, default 12: the
step loop takes a few seconds; most of a run is starting 8 processes and
compiling the plan in each: about 20 s a run on a quiet 2-core machine,
11 minutes for the whole benchmark at 5 repeats); rank 0 prints only its opening line, its last step
and its summary, and no metrics file is written (the plan's own
`metrics.jsonl` would land in `examples/`). `--layouts` picks some of the
layouts; dp 8 always runs, as the baseline.

    python bench/layout_ratios.py [--repeats 5] [--steps 12] [--warmup 2]
                                  [--layouts dp8,tp2,tp2sp,pp2,cp2,zero3] [--profile hw.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PLAN = ROOT / "examples" / "tiny_gpt_cpu.ptc"
BASELINE = "dp8"
LAYOUTS = {
    "dp8": {},
    "tp2": {"parallel.tp": 2, "parallel.dp": 4},
    "tp2sp": {"parallel.tp": 2, "parallel.dp": 4, "parallel.sequence_parallel": "true"},
    "pp2": {"parallel.pp": 2, "parallel.dp": 4},
    "cp2": {"parallel.cp": 2, "parallel.dp": 4},
    "zero3": {"parallel.zero": 3},
}
"""Each layout's overrides of the README plan (`--section.key value` on the command line)."""
WITHIN = 0.10
"""The largest |predicted ratio / measured ratio - 1| counted as agreeing."""


def calibrate(folder: Path) -> Path:
    """Run `ptc calibrate` on the README plan, as a user would, writing the profile into
    `folder`; return its path."""
    profile = folder / "hw.json"
    subprocess.run([sys.executable, "-m", "ptc", "calibrate", str(PLAN), "-o", str(profile)],
                   check=True, cwd=ROOT)
    return profile


def layout_plan(name: str, profile: Path, steps: int):
    """The README plan under layout `name`, priced with the calibration `profile`, training
    `steps` steps, printing only its last step's line (between the run's opening and closing
    lines) and writing no metrics file."""
    import ptc

    overrides = {**LAYOUTS[name], "hardware.profile": str(profile.resolve()),
                 "train.steps": steps, "runtime.log_every": steps}
    plan = ptc.load_plan(PLAN, overrides=overrides)
    return dataclasses.replace(plan, runtime=dataclasses.replace(plan.runtime, metrics=None))


def measured_step(plan, warmup: int) -> float:
    """Train `plan` once on its local processes; the median step time (s) of rank 0's steps
    after the first `warmup` (allocations, gloo's first connections, lazy imports)."""
    import ptc

    steps = ptc.run(plan).steps
    return statistics.median(s.step_time for s in steps[warmup:])


def measure_all(plans: dict, repeats: int, warmup: int) -> dict[str, list[float]]:
    """Each layout's median step times, one per repeat; the layouts take turns, so slow
    spells of the machine spread over all of them."""
    times: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(repeats):
        for name, plan in plans.items():
            times[name].append(measured_step(plan, warmup))
    return times


def ratios(predicted: dict[str, float],
           times: dict[str, list[float]]) -> dict[str, tuple[float, float]]:
    """Each layout's (predicted, measured) step time over dp 8's; measured ones from the
    median over runs."""
    measured = {name: statistics.median(t) for name, t in times.items()}
    return {name: (predicted[name] / predicted[BASELINE], measured[name] / measured[BASELINE])
            for name in times}


def table(predicted: dict[str, float], times: dict[str, list[float]]):
    """The table (ptc's `FitTable`: no number cut at any width): per layout the predicted and
    measured ms/step (the median over runs, and its min–max), both ratios to dp 8 and
    their relative difference."""
    from ptc.views.tables import FitTable

    runs = len(times[BASELINE])
    out = FitTable(title=f"README plan on 8 gloo processes, {runs} run(s) of each layout: "
                         f"step time and its ratio to {BASELINE}")
    for column in ("layout", "predicted ms/step", "measured ms/step", "min–max",
                   "ratio predicted", "ratio measured", "ratio diff"):
        out.add_column(column, justify="left" if column == "layout" else "right")
    for name, (ratio_p, ratio_m) in ratios(predicted, times).items():
        t = times[name]
        out.add_row(name, f"{predicted[name] * 1e3:.1f}", f"{statistics.median(t) * 1e3:.1f}",
                    f"{min(t) * 1e3:.1f}–{max(t) * 1e3:.1f}", f"{ratio_p:.2f}",
                    f"{ratio_m:.2f}", f"{ratio_p / ratio_m - 1:+.1%}")
    return out


def summary(predicted: dict[str, float], times: dict[str, list[float]]) -> str:
    """One line: how many layouts' predicted ratios to dp 8 are within 10 % of the measured
    ones, and the worst."""
    diffs = {name: ratio_p / ratio_m - 1
             for name, (ratio_p, ratio_m) in ratios(predicted, times).items() if name != BASELINE}
    if not diffs:
        return f"only {BASELINE} ran: no ratio to compare"
    worst = max(diffs, key=lambda name: abs(diffs[name]))
    within = sum(abs(d) <= WITHIN for d in diffs.values())
    return (f"{within} of {len(diffs)} predicted ratios within {WITHIN:.0%} of the measured; "
            f"worst {worst}: {diffs[worst]:+.1%}")


def layouts_arg(text: str) -> list[str]:
    """The `--layouts` list, checked against LAYOUTS; the baseline is always run first."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in LAYOUTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown layout(s) {', '.join(unknown)}; "
                                         f"choose from {', '.join(LAYOUTS)}")
    return [BASELINE] + [name for name in names if name != BASELINE]


def main(argv: list[str] | None = None) -> None:
    """Calibrate (or take `--profile`), predict and measure every layout, print the table."""
    from rich.console import Console

    import ptc

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each layout (5)")
    parser.add_argument("--steps", type=int, default=12, help="steps of each run (12)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="first steps of each run left out of its median (2)")
    parser.add_argument("--layouts", type=layouts_arg, default=list(LAYOUTS),
                        help=f"comma-separated, of {','.join(LAYOUTS)} (all); "
                             f"{BASELINE} always runs")
    parser.add_argument("--profile", type=Path,
                        help="an earlier `ptc calibrate` of the README plan (default: "
                             "calibrate now, into a temporary folder)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps <= args.warmup:
        parser.error("--repeats must be at least 1 and --steps above --warmup")
    with tempfile.TemporaryDirectory(prefix="ptc-layout-ratios-") as folder:
        profile = args.profile or calibrate(Path(folder))
        plans = {name: layout_plan(name, profile, args.steps) for name in args.layouts}
        predicted = {name: ptc.estimate(plan).step_time_s for name, plan in plans.items()}
        times = measure_all(plans, args.repeats, args.warmup)
    Console().print(table(predicted, times))
    print(summary(predicted, times))


if __name__ == "__main__":  # ptc.run starts worker processes, which import this file
    main()
