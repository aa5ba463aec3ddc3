"""The zero-bubble schedules against 1F1B, ptc's and torch pipelining's, same model and data.

Four gloo processes train an untied GPT over 4 pipeline ranks with 8 micro-batches eight
ways, ptc's stage split for all: ptc's 1F1B, zero-bubble (ZB-H1), ZB-V and DualPipeV
schedules, torch.distributed.pipelining's `Schedule1F1B`, its
`ScheduleInterleavedZeroBubble` (one stage per rank: its ZB-H1), and its
`ScheduleZBVZeroBubble` and `ScheduleDualPipeV` (ptc's 8-stage V split, two stages per
rank). Every way runs the same step (the global-norm clip
over all stages, AdamW); the ways take turns step by step (`runtime_vs_torch.timed_in_turns`),
and the table shows each one's median step time and, for ptc, the median time each
rank waited for its pipeline peers (`StepStats.comm_wait`: the bubble as it ran),
beside the cost model's bubble (`StepCost.breakdown["bubble"]`, priced for the plan's
hardware, here the CPU preset).

Read the ratios on a machine with a core per process: with fewer (a 2-core
machine runs the 4 processes 2 to a core), a rank that waits gives its core to
another, and the bubble the schedule removes is mostly not there to remove.

    python bench/zero_bubble.py [--hidden 64] [--pp-layers 8] [--seq 32]
                                [--micro-batch 4] [--repeat 5] [--warmup 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_vs_torch import PP_MICROBATCHES, PP_STAGES, make_pp_plan, timed_in_turns  # noqa: E402


KINDS = ("1f1b", "zero_bubble", "zbv", "dualpipev")


def ptc_step(program, waits: list[float]):
    """ptc's Trainer on `program`: its step function, each step's pipeline wait kept."""
    from ptc.runtime.executor import Trainer
    from ptc.runtime.mesh import axis_process_groups, build_mesh
    from ptc.worker import MODELS

    trainer = Trainer(program, axis_process_groups(build_mesh(program.plan)), models=MODELS)

    def step(k: int) -> None:
        waits.append(trainer.train_step(k).comm_wait)

    return step


def torch_step(program, schedule_class):
    """torch pipelining's `schedule_class` on ptc's stage split (`runtime_vs_torch`)."""
    from runtime_vs_torch import torch_pp_step

    return torch_pp_step(program, schedule_class)


def worker(args) -> dict:
    """Every way on this rank; rank 0 returns the medians and every rank's waits."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import (Schedule1F1B, ScheduleDualPipeV,
                                              ScheduleInterleavedZeroBubble,
                                              ScheduleZBVZeroBubble)

    from ptc.lower.driver import compile_plan
    from ptc.runtime.mesh import init_distributed

    torch.set_num_threads(1)
    plan = make_pp_plan(args)
    init_distributed(plan)
    programs = {kind: compile_plan(dataclasses.replace(
        plan, parallel=dataclasses.replace(plan.parallel, schedule=kind)))
        for kind in KINDS}
    waits: dict[str, list[float]] = {kind: [] for kind in KINDS}
    steps = {f"ptc {kind}": ptc_step(programs[kind], waits[kind]) for kind in KINDS}
    steps |= {"torch 1f1b": torch_step(programs["1f1b"], Schedule1F1B),
              "torch zero_bubble": torch_step(programs["1f1b"], ScheduleInterleavedZeroBubble),
              "torch zbv": torch_step(programs["zbv"], ScheduleZBVZeroBubble),
              "torch dualpipev": torch_step(programs["dualpipev"], ScheduleDualPipeV)}
    times = timed_in_turns(steps, args.repeat, args.warmup)
    medians = {kind: statistics.median(w[args.warmup:]) for kind, w in waits.items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, medians)
    predicted = {kind: p.decisions.estimate.breakdown["bubble"] for kind, p in programs.items()}
    dist.destroy_process_group()
    return {"times": times, "waits": every, "predicted": predicted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="gpt", choices=("gpt",))
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--pp-layers", type=int, default=8)
    parser.add_argument("--accum", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    from ptc.runtime.launcher import run_local

    got = run_local(worker, PP_STAGES, args)[0]
    times = got["times"]
    print(f"gpt (untied) h={args.hidden} layers={args.pp_layers} seq={args.seq} "
          f"micro_batch={args.micro_batch}, {PP_STAGES} stages (gloo processes), "
          f"{PP_MICROBATCHES} micro-batches, same stage split, median of {args.repeat} steps")
    for kind in KINDS:
        ours, theirs = times[f"ptc {kind}"], times[f"torch {kind}"]
        waits = " ".join(f"{w[kind] * 1e3:.1f}" for w in got["waits"])
        print(f"  {kind:12s} ptc {ours * 1e3:8.2f} ms   torch {theirs * 1e3:8.2f} ms   "
              f"ptc / torch = {ours / theirs:.2f}   ptc waits per rank (ms): {waits}; "
              f"predicted bubble {got['predicted'][kind] * 1e3:.1f} ms")
    for kind in KINDS[1:]:
        gain = times["ptc 1f1b"] - times[f"ptc {kind}"]
        print(f"  ptc {kind} / ptc 1f1b = {times[f'ptc {kind}'] / times['ptc 1f1b']:.2f} "
              f"({gain * 1e3:+.1f} ms a step)")


if __name__ == "__main__":
    main()
