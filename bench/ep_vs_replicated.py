"""Expert parallelism against replicated experts: ptc with ep = 4 and with ep = 1, same model.

Four gloo processes train the same Hugging Face Mixtral (built in-process from a
tiny config: `--experts` experts, top-`--top-k`, hidden `--hidden`, expert
intermediate `--ffn`, `--layers` layers; the routed experts hold most of the
parameters) from the same weights on the same samples, data parallel over dp = 4,
two ways: `parallel.ep = 4` (each rank holds experts/4 of every layer's experts and
exchanges tokens by all-to-all) and `parallel.ep = 1` (every rank holds every
expert). Plain DP otherwise (ZeRO 0), fp32, AdamW, global-norm clip.

Each configuration runs in a launch of its own (so that a process's peak memory
is that configuration's): it compiles, warms up for `--warmup` steps, then takes
`--repeat` measurements, each the median time of `--steps` consecutive steps
(a barrier on both sides of each step; rank 0's clock). The table shows, per
configuration, the median of those `--repeat` measurements (and their range),
and per rank the largest over the 4 ranks of:

  held MiB   `Trainer.held_bytes()` after training: parameters + gradients +
             optimizer state, the bytes the Trainer holds (what ep shards);
  RSS MiB    the process's peak resident set growth over the launch,
             `resource.getrusage(RUSAGE_SELF).ru_maxrss` at the end less at the
             worker's start (compiled graphs, activations, all-to-all buffers,
             allocator slack: everything the rank's process grew by).

The last row is ep4 / replicated for each column (below 1: ep = 4 is faster or
smaller).

    python bench/ep_vs_replicated.py [--experts 8] [--top-k 2] [--hidden 64] [--ffn 128]
                                     [--layers 2] [--vocab 256] [--seq 64] [--micro-batch 1]
                                     [--accum 1] [--warmup 2] [--repeat 5] [--steps 5]

On a machine with fewer cores than processes (2 cores, 4 ranks) read the time
ratio with care: the ranks share the cores, so the expert products ep saves
each rank are small next to what the all-to-alls and their synchronisation cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

NPROC = 4
SEED = 13
FACTORY = "ep_vs_replicated:mixtral"
"""The plan's model factory: `mixtral` below, importable in the ranks (bench/ is on
their path, as they import this script)."""


def mixtral(**config):
    """A Mixtral built from `config` (MixtralConfig's keywords): the benchmark's model."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(**config))


def model_config(args) -> dict:
    """The MixtralConfig keywords of the benchmark's model."""
    return {"vocab_size": args.vocab, "hidden_size": args.hidden, "intermediate_size": args.ffn,
            "num_hidden_layers": args.layers, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": args.seq,
            "num_local_experts": args.experts, "num_experts_per_tok": args.top_k,
            "bos_token_id": 0, "eos_token_id": 0}


def make_plan(args, ep: int):
    """The benchmark plan: the Mixtral, dp = 4 gloo processes, expert parallelism `ep`."""
    from ptc.plan import (DataSpec, HardwareSpec, ModelSpec, OptimizerSpec, ParallelSpec, Plan,
                          RuntimeSpec, TrainSpec)

    return Plan(
        model=ModelSpec(family="custom", factory=FACTORY, kwargs=model_config(args),
                        max_seq=args.seq),
        hardware=HardwareSpec.preset("cpu", gpus_per_node=NPROC),
        parallel=ParallelSpec(dp=NPROC, ep=ep),
        train=TrainSpec(seq_len=args.seq, micro_batch=args.micro_batch,
                        global_batch=NPROC * args.micro_batch * args.accum, dtype="fp32",
                        steps=args.warmup + args.repeat * args.steps, grad_clip=1.0,
                        optimizer=OptimizerSpec(lr=1e-3), data=DataSpec(seed=1)),
        runtime=RuntimeSpec(backend="gloo"))


def max_rss() -> int:
    """This process's peak resident set so far, bytes (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(args, ep: int) -> dict:
    """Train the plan with expert parallelism `ep` on this rank: rank 0's measurements and
    every rank's held bytes and peak RSS growth."""
    import torch
    import torch.distributed as dist

    from ptc.lower.driver import compile_plan
    from ptc.runtime.executor import Trainer
    from ptc.runtime.mesh import axis_process_groups, build_mesh, init_distributed
    from ptc.worker import MODELS

    start_rss = max_rss()
    torch.set_num_threads(1)
    plan = make_plan(args, ep)
    init_distributed(plan)
    torch.manual_seed(SEED)  # every rank the same weights
    program = compile_plan(plan, model=mixtral(**model_config(args)))
    trainer = Trainer(program, axis_process_groups(build_mesh(plan), plan.parallel.ep),
                      models=MODELS)
    step = 0
    for _ in range(args.warmup):
        trainer.train_step(step)
        step += 1
    measurements = []
    for _ in range(args.repeat):
        times = []
        for _ in range(args.steps):
            dist.barrier()
            begin = time.perf_counter()
            trainer.train_step(step)
            dist.barrier()
            times.append(time.perf_counter() - begin)
            step += 1
        measurements.append(statistics.median(times))
    held = trainer.held_bytes()
    mine = {"held": held["params"] + held["grads"] + held["optimizer"],
            "rss": max_rss() - start_rss}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    dist.destroy_process_group()
    return {"measurements": measurements, "ranks": every}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=128, help="each expert's intermediate size")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5, help="measurements per configuration")
    parser.add_argument("--steps", type=int, default=5,
                        help="timed steps per measurement (their median)")
    args = parser.parse_args()

    import torch

    from ptc.runtime.launcher import run_local

    torch.manual_seed(SEED)
    model = mixtral(**model_config(args))
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    del model

    results = {}
    for name, ep in (("replicated (ep 1)", 1), (f"ep {NPROC}", NPROC)):
        got = run_local(worker, NPROC, args, ep)[0]
        results[name] = {"time": statistics.median(got["measurements"]),
                         "range": (min(got["measurements"]), max(got["measurements"])),
                         "held": max(r["held"] for r in got["ranks"]),
                         "rss": max(r["rss"] for r in got["ranks"])}

    print(f"mixtral {args.experts} experts top-{args.top_k} h={args.hidden} ffn={args.ffn} "
          f"layers={args.layers} vocab={args.vocab} seq={args.seq} "
          f"micro_batch={args.micro_batch} accum={args.accum}: {total / 1e3:.0f}k parameters, "
          f"{experts / total:.0%} in experts; dp={NPROC} gloo processes, fp32 AdamW; "
          f"median of {args.repeat} measurements, each the median of {args.steps} steps "
          f"after {args.warmup} warm-up steps; memory per rank, the largest rank's")
    print(f"  {'configuration':18s} {'step ms':>9s} {'(range)':>17s} {'held MiB':>9s} "
          f"{'RSS MiB':>8s}")
    for name, r in results.items():
        low, high = r["range"]
        print(f"  {name:18s} {r['time'] * 1e3:9.2f} {f'({low * 1e3:.1f}-{high * 1e3:.1f})':>17s} "
              f"{r['held'] / 2**20:9.2f} {r['rss'] / 2**20:8.1f}")
    ep_row, rep = results[f"ep {NPROC}"], results["replicated (ep 1)"]
    print(f"  {f'ep{NPROC} / replicated':18s} {ep_row['time'] / rep['time']:9.2f} {'':17s} "
          f"{ep_row['held'] / rep['held']:9.2f} {ep_row['rss'] / rep['rss']:8.2f}")


if __name__ == "__main__":
    main()
