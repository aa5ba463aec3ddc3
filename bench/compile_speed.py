"""Whole-process `ptc compile` time of the 80-layer Llama-3-70B example against a shallow copy.

Runs `python -m ptc compile PLAN` in a fresh process (imports count, as they
do for a user), `--repeat` times for each of two plans, and prints the
median wall time, the median CPU time of the process (user + system: on a
shared machine it moves less than the wall time), and the ratio deep/small.
Compile cost should be flat in depth: the layers are alike, so 80 of them
should cost about what 2 cost.

- deep: `examples/llama70b_h100x64_tp8_pp4_dp2.ptc` as it is (80 layers,
  tp 8, sequence parallel, pp 4 with 2 virtual stages, dp 2, ZeRO 1).
- small: the same plan with `--small-layers` layers (default 2). A plan's
  layer count must be divisible by pp · virtual_stages, so where it is not
  the small plan drops to 1 virtual stage (schedule 1f1b) and then to the
  largest pp that divides the layers, with as many nodes fewer as keep tp
  and dp (2 layers: pp 2, 1f1b, 4 nodes). `--small-layers 8` keeps the
  whole parallel section: one layer per stage.

    python bench/compile_speed.py [--plan FILE] [--small-layers 2] [--repeat 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ptc.dsl import dump_plan, load_plan  # noqa: E402
from ptc.plan import Plan  # noqa: E402

EXAMPLE = ROOT / "examples" / "llama70b_h100x64_tp8_pp4_dp2.ptc"


def shallow_plan(plan: Plan, layers: int) -> Plan:
    """`plan` with `layers` layers, its pipeline reduced only as far as the layer count needs."""
    par, hw = plan.parallel, plan.hardware
    if layers % (par.pp * par.virtual_stages):
        par = dataclasses.replace(par, schedule="1f1b", virtual_stages=1)
    pp = max(p for p in range(1, par.pp + 1) if layers % p == 0 and par.pp % p == 0)
    hw = dataclasses.replace(hw, nodes=hw.nodes * pp // par.pp)
    return dataclasses.replace(plan, model=dataclasses.replace(plan.model, layers=layers),
                               parallel=dataclasses.replace(par, pp=pp), hardware=hw)


def describe(plan: Plan) -> str:
    """One line naming the plan's depth and layout."""
    p = plan.parallel
    return (f"{plan.model.layers} layers, tp {p.tp} pp {p.pp} (v {p.virtual_stages}, "
            f"{p.schedule}) dp {p.dp} zero {p.zero}, sp {p.sequence_parallel}, "
            f"{plan.num_gpus} GPUs")


def compile_once(path: Path) -> tuple[float, float]:
    """Wall and CPU seconds of one `python -m ptc compile path` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ptc", "compile", str(path)], cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"ptc compile {path} failed ({done.returncode}):\n{done.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def medians(path: Path, repeat: int) -> tuple[float, float]:
    """Median wall and CPU seconds of `repeat` compiles of `path`."""
    runs = [compile_once(path) for _ in range(repeat)]
    return statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)


def main(argv: list[str] | None = None) -> int:
    """Time both plans; print their medians and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=Path, default=EXAMPLE)
    parser.add_argument("--small-layers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    deep = load_plan(args.plan)
    small = shallow_plan(deep, args.small_layers)
    with tempfile.TemporaryDirectory() as directory:
        small_path = Path(directory) / "small.ptc"
        small_path.write_text(dump_plan(small))
        rows = [("deep", deep, args.plan), ("small", small, small_path)]
        print(f"ptc compile, whole process, median of {args.repeat}")
        print(f"{'plan':>5}  {'wall':>7}  {'cpu':>7}  layout")
        results = {}
        for name, plan, path in rows:
            results[name] = medians(path, args.repeat)
            wall, cpu = results[name]
            print(f"{name:>5}  {wall:>6.2f}s  {cpu:>6.2f}s  {describe(plan)}")
    (deep_wall, deep_cpu), (small_wall, small_cpu) = results["deep"], results["small"]
    print(f"ratio deep/small: wall {deep_wall / small_wall:.2f}, cpu {deep_cpu / small_cpu:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
