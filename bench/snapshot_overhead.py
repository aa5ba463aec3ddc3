"""What in-memory snapshots cost a step: the README plan with and without `snapshot_every = 1`.

The README plan (`examples/tiny_gpt_cpu.ptc`, 8 local gloo processes) trains
`--steps` steps with a checkpoint folder and storage checkpoints only at the
end, once without snapshots and once with a snapshot after every step
(`runtime.snapshot_every = 1`, `ptc.runtime.snapshot`: each rank copies its
state to host buffers, then a background thread writes it to tmpfs and sends
it to its peer). Each run's median step time after `--warmup` steps is rank
0's `StepStats.step_time`; the two plans take turns `--repeats` times and the
medians over runs are compared: the ratio is the snapshot's cost per step, in
the same run of the benchmark, on the same machine.

    python bench/snapshot_overhead.py [--repeats 5] [--steps 20] [--warmup 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PLAN = ROOT / "examples" / "tiny_gpt_cpu.ptc"


def plan_with(snapshots: bool, folder: Path, steps: int):
    """The README plan training `steps` steps into a checkpoint folder of its own, saving
    to storage only at the end, with or without a snapshot after every step; no metrics
    file, and only the last step's line printed."""
    import ptc

    plan = ptc.load_plan(PLAN, overrides={"train.steps": steps, "runtime.log_every": steps})
    runtime = dataclasses.replace(plan.runtime, metrics=None, checkpoint_every=None,
                                  checkpoint_interval=None, checkpoint_dir=str(folder),
                                  snapshot_every=1 if snapshots else None)
    return dataclasses.replace(plan, runtime=runtime)


def median_step(plan, warmup: int) -> float:
    """Train `plan` once; the median of rank 0's step times after the first `warmup`."""
    import ptc

    return statistics.median(s.step_time for s in ptc.run(plan).steps[warmup:])


def main(argv: list[str] | None = None) -> None:
    """Measure both plans in turns and print their medians and the snapshot's cost."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each plan (5)")
    parser.add_argument("--steps", type=int, default=20, help="steps of each run (20)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out (3)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps <= args.warmup:
        parser.error("--repeats must be at least 1 and --steps above --warmup")
    times: dict[str, list[float]] = {"storage only": [], "snapshot every step": []}
    with tempfile.TemporaryDirectory(prefix="ptc-snapshot-bench-") as folder:
        for repeat in range(args.repeats):
            for name in times:
                run_folder = Path(folder) / f"{repeat}-{len(times[name])}-{name[:7]}"
                plan = plan_with(name != "storage only", run_folder, args.steps)
                times[name].append(median_step(plan, args.warmup))
    base, snap = (statistics.median(t) for t in times.values())
    for name, t in times.items():
        print(f"{name:<22} median {statistics.median(t) * 1e3:7.1f} ms/step "
              f"(runs {min(t) * 1e3:.1f}-{max(t) * 1e3:.1f})")
    print(f"a snapshot every step costs {snap / base - 1:+.1%} of the step "
          f"(median of {args.repeats} runs each)")


if __name__ == "__main__":  # ptc.run starts worker processes, which import this file
    main()
