"""Step time and exposed communication with and without ptc's communication overlap.

Four gloo processes train the same GPT with ZeRO-3 over dp = 4 (the
communication-heavy layout: every layer's weights are all-gathered in
forward, again in backward, and its gradient reduce-scattered) twice: with
`parallel.overlap = true` (the comm_overlap pass starts each gather one
layer early, backward prefetches the next re-gather and leaves two gradient
reductions running) and with `overlap = false` (every collective is waited
for as soon as it is issued). Both use the same buckets, weights and data.
`--zero 2` benchmarks ZeRO-2's bucketed reduce-scatters instead.

The two ways take turns step by step, so load spikes on the machine hit
both alike. *Exposed communication* is the time a rank spends blocked in
`Work.wait` (`ptc.ops.comm.comm_wait_seconds`): communication that
computation did not hide. Without overlap that is nearly all of it. The
table shows medians over `--repeat` steps (rank 0) and the share of the step
that was exposed communication.

    python bench/overlap.py [--hidden 256] [--layers 4] [--seq 64] [--micro-batch 2]
                            [--accum 2] [--repeat 7] [--warmup 2] [--zero 3] [--nproc 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_plan(args, overlap: bool):
    """The benchmark plan: a GPT on `nproc` CPU processes, ZeRO stage `zero` over dp."""
    from ptc.plan import (DataSpec, HardwareSpec, ModelSpec, OptimizerSpec, ParallelSpec, Plan,
                          RuntimeSpec, TrainSpec)

    model = ModelSpec(family="gpt", layers=args.layers, hidden=args.hidden, heads=4,
                      vocab=args.vocab, max_seq=args.seq)
    return Plan(model=model, hardware=HardwareSpec.preset("cpu", gpus_per_node=args.nproc),
                parallel=ParallelSpec(dp=args.nproc, zero=args.zero, overlap=overlap),
                train=TrainSpec(seq_len=args.seq, micro_batch=args.micro_batch,
                                global_batch=args.nproc * args.micro_batch * args.accum,
                                dtype="fp32", steps=args.warmup + args.repeat, grad_clip=1.0,
                                optimizer=OptimizerSpec(lr=1e-3), data=DataSpec(seed=1)),
                runtime=RuntimeSpec(backend="gloo"))


def measure(args) -> dict[str, dict[str, float]] | None:
    """Worker: train both ways in turns; rank 0 returns median step and exposed seconds."""
    import torch.distributed as dist

    from ptc.lower.driver import compile_plan
    from ptc.ops.comm import comm_wait_seconds
    from ptc.runtime.executor import Trainer
    from ptc.worker import MODELS
    from ptc.runtime.mesh import axis_process_groups, build_mesh, init_distributed

    plans = {"overlap": make_plan(args, True), "no overlap": make_plan(args, False)}
    init_distributed(plans["overlap"])
    groups = axis_process_groups(build_mesh(plans["overlap"]))
    trainers = {name: Trainer(compile_plan(plan), groups, models=MODELS)
                for name, plan in plans.items()}
    samples: dict[str, dict[str, list[float]]] = {n: {"step": [], "exposed": []} for n in plans}
    for k in range(args.warmup + args.repeat):
        for name, trainer in trainers.items():
            dist.barrier()
            waited, start = comm_wait_seconds(), time.perf_counter()
            trainer.train_step(k)
            step, exposed = time.perf_counter() - start, comm_wait_seconds() - waited
            if k >= args.warmup:
                samples[name]["step"].append(step)
                samples[name]["exposed"].append(exposed)
    buckets = {name: len(t.overlap.buckets) for name, t in trainers.items()}
    dist.destroy_process_group()
    return {name: {"step": statistics.median(s["step"]),
                   "exposed": statistics.median(s["exposed"]),
                   "share": statistics.median(e / t for e, t in zip(s["exposed"], s["step"])),
                   "buckets": buckets[name]}
            for name, s in samples.items()}


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print the table."""
    from rich.console import Console
    from rich.table import Table

    from ptc.runtime.launcher import run_local

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--zero", type=int, default=3, choices=(0, 1, 2, 3))
    parser.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args(argv)
    result = run_local(measure, args.nproc, args)[0]
    table = Table(title=f"GPT h={args.hidden} L={args.layers} s={args.seq}, ZeRO-{args.zero} "
                        f"dp={args.nproc}, gloo CPU, median of {args.repeat} steps")
    for column in ("way", "buckets", "step", "exposed comm", "exposed share"):
        table.add_column(column, justify="left" if column == "way" else "right")
    for name, r in result.items():
        table.add_row(name, str(r["buckets"]), f"{r['step'] * 1e3:.1f} ms",
                      f"{r['exposed'] * 1e3:.1f} ms", f"{r['share']:.1%}")
    console = Console()
    console.print(table)
    on, off = result["overlap"], result["no overlap"]
    console.print(f"step time overlap / no overlap = {on['step'] / off['step']:.2f}; exposed "
                  f"communication {off['exposed'] * 1e3:.1f} -> {on['exposed'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
