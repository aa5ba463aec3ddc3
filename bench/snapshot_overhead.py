"""What in-memory snapshots cost a step: the README plan with and without `snapshot_every = 1`.

The README plan (`examples/tiny_gpt_cpu.ptc`, 8 local gloo processes) trains
`--steps` steps with a checkpoint folder and storage checkpoints only at the
end, once without snapshots and once with a snapshot after every step
(`runtime.snapshot_every = 1`, `ptc.runtime.snapshot`: each rank writes its
state to tmpfs, then a background thread sends it to its peer while the next
step trains). A step here is the wall time between two of rank 0's metrics
records (their `time`): the step and everything the loop does around it, the
snapshot's pause included. Each run's median after `--warmup` steps is
taken; the two plans take turns `--repeats` times and the medians over runs
are compared: the ratio is the snapshot's cost per step, in the same run of
the benchmark, on the same machine.

    python bench/snapshot_overhead.py [--repeats 5] [--steps 20] [--warmup 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PLAN = ROOT / "examples" / "tiny_gpt_cpu.ptc"


def plan_with(snapshots: bool, folder: Path, steps: int):
    """The README plan training `steps` steps into a checkpoint folder of its own, saving
    to storage only at the end, with or without a snapshot after every step; its metrics
    file in that folder, and only the last step's line printed."""
    import ptc

    plan = ptc.load_plan(PLAN, overrides={"train.steps": steps, "runtime.log_every": steps})
    runtime = dataclasses.replace(plan.runtime, metrics=str(folder / "metrics.jsonl"),
                                  checkpoint_every=None, checkpoint_interval=None,
                                  checkpoint_dir=str(folder),
                                  snapshot_every=1 if snapshots else None)
    return dataclasses.replace(plan, runtime=runtime)


def median_step(plan, warmup: int) -> float:
    """Train `plan` once; the median wall time between rank 0's metrics records after the
    first `warmup` steps."""
    import ptc

    ptc.run(plan)
    records = Path(plan.runtime.metrics).read_text().splitlines()
    times = [json.loads(line)["time"] for line in records][warmup:]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


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
