"""Step time of ptc's runtime against PyTorch's own data parallelism, same model, same data.

Two gloo processes on this machine train the same tiny model from the same
weights on the same samples four ways: ptc ZeRO-0 (plain DP) against
`DistributedDataParallel`, and ptc ZeRO-3 against FSDP2 (`fully_shard` per
layer and at the root). Every way runs the same step: micro-batches with
gradient accumulation (DDP: `no_sync` but the last; FSDP2: reduce-scatter per
micro-batch, as ptc does), global-norm clipping, AdamW. Each way warms up,
then times `--repeat` steps (a barrier on both sides of each), ptc and its
peer taking turns step by step; the table shows the median step time and
ptc / torch (below 1: ptc is faster).

Pipeline parallelism (`--pp`, on by default): four gloo processes train an
untied GPT (`--pp-layers`) with 1F1B over 4 stages and 8 micro-batches, as
ptc's Trainer and as torch.distributed.pipelining's Schedule1F1B on
the same stage split (ptc's, read off the compiled Program), each step with
the global-norm clip over all stages and AdamW.

Tensor parallelism (`--tp`, on by default): two gloo processes train a
Llama (`--tp-hidden`; separate q/k/v, SwiGLU, RoPE) with tp = 2, with and
without sequence parallelism, as ptc (its passes find the split) and as
eager PyTorch under `parallelize_module` with ColwiseParallel /
RowwiseParallel (and SequenceParallel on the norms, PrepareModuleInput on
attention and MLP), vocabulary-parallel embedding and head with
`loss_parallel` — torchtitan's Llama plan — with the head counts of each
attention set to the local ones, as torchtitan does. Same weights, data,
micro-batches, clipping and AdamW.

    python bench/runtime_vs_torch.py [--family gpt] [--hidden 64] [--layers 2]
                                     [--seq 32] [--micro-batch 4] [--accum 2] [--repeat 5]
                                     [--pp-layers 8] [--tp-hidden 128] [--no-dp] [--no-pp]
                                     [--no-tp] [--compile]

`--compile` adds a compiled pair to the data-parallel comparison: ptc with
`runtime.compile = true` (each stage graph through torch.compile) against
DDP of the torch.compile'd model, both on inductor.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NPROC = 2


def make_plan(args, zero: int, compiled: bool = False):
    """The benchmark plan: the tiny model on 2 CPU processes at ZeRO stage `zero`
    (`compiled`: its stage graphs run through torch.compile)."""
    from ptc.plan import (DataSpec, HardwareSpec, ModelSpec, OptimizerSpec, ParallelSpec, Plan,
                          RuntimeSpec, TrainSpec)

    model = ModelSpec(family=args.family, layers=args.layers, hidden=args.hidden, heads=4,
                      vocab=args.vocab, max_seq=args.seq,
                      ffn=4 * args.hidden if args.family == "llama" else None)
    return Plan(model=model, hardware=HardwareSpec.preset("cpu", gpus_per_node=NPROC),
                parallel=ParallelSpec(dp=NPROC, zero=zero),
                train=TrainSpec(seq_len=args.seq, micro_batch=args.micro_batch,
                                global_batch=NPROC * args.micro_batch * args.accum, dtype="fp32",
                                steps=args.warmup + args.repeat, grad_clip=1.0,
                                optimizer=OptimizerSpec(lr=1e-3), data=DataSpec(seed=1)),
                runtime=RuntimeSpec(backend="gloo", compile=compiled))


def timed(step, repeat: int, warmup: int) -> float:
    """Median seconds of `step(k)` over `repeat` steps after `warmup`, all ranks in lockstep."""
    import torch.distributed as dist

    times = []
    for k in range(warmup + repeat):
        dist.barrier()
        start = time.perf_counter()
        step(k)
        dist.barrier()
        if k >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def ptc_step(args, zero: int, compiled: bool = False):
    """ptc's runtime at ZeRO stage `zero` (`compiled`: runtime.compile): its step function."""
    from ptc.lower.driver import compile_plan
    from ptc.runtime.executor import Trainer
    from ptc.worker import MODELS
    from ptc.runtime.mesh import axis_process_groups, build_mesh

    plan = make_plan(args, zero, compiled)
    return Trainer(compile_plan(plan), axis_process_groups(build_mesh(plan)), models=MODELS).train_step


def torch_step(args, wrap: str, compiled: bool = False):
    """Eager PyTorch with DDP ("ddp") or FSDP2 ("fsdp2") on the same model, data and optimizer
    (`compiled`: the model under torch.compile, inside DDP as PyTorch recommends): its step
    function."""
    import contextlib

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from ptc.models import build_model
    from ptc.runtime.data import TokenSource, microbatch_start

    plan = make_plan(args, 0)
    train = plan.train
    model = build_model(plan.model, device="cpu", seed=0)
    if wrap == "ddp":
        model = DistributedDataParallel(model)
        if compiled:
            model = torch.compile(model)
    else:
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=train.optimizer.lr)
    source = TokenSource(train.data, vocab=plan.model.vocab, seq_len=train.seq_len)
    rank, micros = dist.get_rank(), plan.num_microbatches

    def step(k: int) -> None:
        for m in range(micros):
            first = microbatch_start(k, m, dp_rank=rank, dp=NPROC, global_batch=train.global_batch,
                                     micro_batch=train.micro_batch)
            tokens, targets = source.batch(first, train.micro_batch)
            last = m == micros - 1
            sync = model.no_sync() if wrap == "ddp" and not last else contextlib.nullcontext()
            with sync:
                loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
                (loss / micros).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        opt.step()
        opt.zero_grad()

    return step


def worker(args) -> dict[str, float]:
    """Run every way on this rank; rank 0's numbers are the result."""
    import torch
    import torch.distributed as dist

    from ptc.runtime.mesh import init_distributed

    torch.set_num_threads(1)
    init_distributed(make_plan(args, 0))
    # Each pair takes turns step by step, so a change of load slows both alike.
    result = {**timed_in_turns({"ptc dp (zero 0)": ptc_step(args, 0),
                                "torch DDP": torch_step(args, "ddp")}, args.repeat, args.warmup),
              **timed_in_turns({"ptc zero 3": ptc_step(args, 3),
                                "torch FSDP2": torch_step(args, "fsdp2")},
                               args.repeat, args.warmup)}
    if args.compile:
        result.update(timed_in_turns({"ptc dp compiled": ptc_step(args, 0, compiled=True),
                                      "torch DDP compiled": torch_step(args, "ddp", compiled=True)},
                                     args.repeat, args.warmup))
    dist.destroy_process_group()
    return result


PP_STAGES = 4
PP_MICROBATCHES = 8


def make_pp_plan(args):
    """The pipeline benchmark plan: an untied GPT on 4 stages, 1F1B over 8 micro-batches.

    Untied, because torch.distributed.pipelining has no tied weights across stages.
    """
    import dataclasses

    from ptc.plan import ParallelSpec

    base = make_plan(args, 0)
    return dataclasses.replace(
        base, model=dataclasses.replace(base.model, layers=args.pp_layers, tied_embeddings=False),
        hardware=dataclasses.replace(base.hardware, gpus_per_node=PP_STAGES),
        parallel=ParallelSpec(pp=PP_STAGES, schedule="1f1b"),
        train=dataclasses.replace(base.train, global_batch=PP_MICROBATCHES * args.micro_batch))


def timed_in_turns(steps: dict, repeat: int, warmup: int) -> dict[str, float]:
    """Median seconds of each way's `step(k)`, the ways taking turns step by step.

    Taking turns, a change in the machine's load (other jobs on shared
    cores) slows both ways alike instead of whichever happens to run then.
    """
    import torch.distributed as dist

    times: dict[str, list[float]] = {name: [] for name in steps}
    for k in range(warmup + repeat):
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            step(k)
            dist.barrier()
            if k >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def ptc_pp_step(program):
    """ptc's pipeline runtime on `program`: its step function."""
    from ptc.runtime.mesh import axis_process_groups, build_mesh
    from ptc.runtime.executor import Trainer
    from ptc.worker import MODELS

    return Trainer(program, axis_process_groups(build_mesh(program.plan)), models=MODELS).train_step


def torch_pp_step(program, schedule_class=None):
    """torch.distributed.pipelining's Schedule1F1B (or `schedule_class`, e.g. its
    ScheduleInterleavedZeroBubble, or with two stages per rank in ptc's V its
    ScheduleZBVZeroBubble) with ptc's stage split, each rank holding the stages ptc places
    on it: its step function."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    from ptc.compiler.graph.stage_graphs import stage_info
    from ptc.models import build_model
    from ptc.runtime.data import TokenSource

    plan, rank = program.plan, dist.get_rank()
    model = build_model(plan.model, device="cpu", seed=0)

    class Part(nn.Module):
        """The GPT modules of one ptc stage, run in GPT.forward's order."""

        def __init__(self, atoms: tuple[str, ...]) -> None:
            super().__init__()
            if ("embed" in atoms) != ("pos_embed" in atoms):
                raise SystemExit(f"ptc's stage splits embed from pos_embed: {atoms}")
            self.embeds = nn.ModuleList([model.embed, model.pos_embed]) if "embed" in atoms \
                else None
            self.layers = nn.ModuleList(model.layers[int(a.split(".")[1])] for a in atoms
                                        if a.startswith("layers."))
            self.ends = nn.ModuleList(getattr(model, a) for a in ("norm", "head") if a in atoms)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.embeds is not None:
                x = self.embeds[0](x) + self.embeds[1](torch.arange(x.size(1)))
            for module in (*self.layers, *self.ends):
                x = module(x)
            return x

    mine = program.schedule.stages_of(rank)
    count = len(program.stages)
    parts = [Part(stage_info(program.stages[s].graph).atoms) for s in mine]
    stages = [PipelineStage(part, s, count, torch.device("cpu")) for s, part in zip(mine, parts)]
    schedule_class = schedule_class or Schedule1F1B
    multi = issubclass(schedule_class, PipelineScheduleMulti)  # takes a list of stages
    if not multi and len(stages) != 1:
        raise SystemExit(f"{schedule_class.__name__} runs one stage per rank; ptc placed "
                         f"{len(stages)} on rank {rank}")
    schedule = schedule_class(stages if multi else stages[0], PP_MICROBATCHES,
                              loss_fn=lambda out, target: F.cross_entropy(
                                  out.flatten(0, 1), target.flatten()))
    weights = [p for part in parts for p in part.parameters()]
    opt = torch.optim.AdamW(weights, lr=plan.train.optimizer.lr)
    source = TokenSource(plan.train.data, vocab=plan.model.vocab, seq_len=plan.train.seq_len)
    batch = plan.train.global_batch

    def step(k: int) -> None:
        # Only the ranks of the first and last stage read samples, as ptc's.
        first, last = 0 in mine, count - 1 in mine
        tokens, targets = source.batch(k * batch, batch) if first or last else (None, None)
        ends = {"target": targets, "losses": []} if last else {}
        schedule.step(*([tokens] if first else []), **ends)
        # The global-norm clip over all stages, as ptc's.
        squares = torch.stack([p.grad.pow(2).sum() for p in weights]).sum()
        dist.all_reduce(squares)
        factor = (plan.train.grad_clip / (squares.sqrt() + 1e-6)).clamp(max=1.0)
        for p in weights:
            p.grad.mul_(factor)
        opt.step()
        opt.zero_grad()

    return step


def pp_worker(args) -> dict[str, float]:
    """Both pipelines on this rank, ptc's split compiled once for both; rank 0's numbers count."""
    import torch
    import torch.distributed as dist

    from ptc.lower.driver import compile_plan
    from ptc.runtime.mesh import init_distributed

    torch.set_num_threads(1)
    plan = make_pp_plan(args)
    init_distributed(plan)
    program = compile_plan(plan)
    result = timed_in_turns({"ptc": ptc_pp_step(program), "torch": torch_pp_step(program)},
                            args.repeat, args.warmup)
    dist.destroy_process_group()
    return result


TP = 2


def make_tp_plan(args, sp: bool):
    """The tensor-parallel benchmark plan: a Llama of `--tp-hidden` on tp = 2 processes."""
    import dataclasses

    from ptc.plan import ModelSpec, ParallelSpec

    base = make_plan(args, 0)
    model = ModelSpec(family="llama", layers=args.layers, hidden=args.tp_hidden, heads=4,
                      ffn=4 * args.tp_hidden, vocab=args.vocab, max_seq=args.seq)
    return dataclasses.replace(
        base, model=model, parallel=ParallelSpec(tp=TP, sequence_parallel=sp),
        train=dataclasses.replace(base.train, global_batch=args.micro_batch * args.accum))


def ptc_tp_step_time(args, sp: bool) -> float:
    """ptc's runtime with tp = 2 (and sequence parallelism when `sp`)."""
    from ptc.lower.driver import compile_plan
    from ptc.runtime.executor import Trainer
    from ptc.worker import MODELS
    from ptc.runtime.mesh import axis_process_groups, build_mesh

    plan = make_tp_plan(args, sp)
    trainer = Trainer(compile_plan(plan), axis_process_groups(build_mesh(plan)), models=MODELS)
    return timed(trainer.train_step, args.repeat, args.warmup)


def torch_tp_step_time(args, sp: bool) -> float:
    """Eager Llama under torch's parallelize_module (torchtitan's plan), same step."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   loss_parallel, parallelize_module)

    from ptc.models import build_model
    from ptc.runtime.data import TokenSource

    plan = make_tp_plan(args, sp)
    train = plan.train
    model = build_model(plan.model, device="cpu", seed=0)
    mesh = init_device_mesh("cpu", (TP,))
    seq = Shard(1) if sp else Replicate()
    parallelize_module(model, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "norm": SequenceParallel() if sp else None,
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                use_local_output=False)})
    for layer in model.layers:
        layer_plan = {f"attn.{x}": ColwiseParallel() for x in ("q", "k", "v")}
        layer_plan |= {f"mlp.{x}": ColwiseParallel() for x in ("gate", "up")}
        layer_plan |= {"attn.o": RowwiseParallel(output_layouts=seq),
                       "mlp.down": RowwiseParallel(output_layouts=seq)}
        if sp:
            layer_plan |= {"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()}
            layer_plan |= {m: PrepareModuleInput(input_layouts=(Shard(1),),
                                                 desired_input_layouts=(Replicate(),))
                           for m in ("attn", "mlp")}
        parallelize_module(layer, mesh, layer_plan)
        layer.attn.heads //= TP  # the view to heads must use the local head counts
        layer.attn.kv_heads //= TP
    opt = torch.optim.AdamW(model.parameters(), lr=train.optimizer.lr)
    source = TokenSource(train.data, vocab=plan.model.vocab, seq_len=train.seq_len)
    micros = plan.num_microbatches

    def step(k: int) -> None:
        for m in range(micros):
            tokens, targets = source.batch(k * train.global_batch + m * train.micro_batch,
                                           train.micro_batch)
            with loss_parallel():
                loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
                (loss / micros).backward()
        clip_mixed(model.parameters(), train.grad_clip)
        opt.step()
        opt.zero_grad()

    return timed(step, args.repeat, args.warmup)


def clip_mixed(parameters, max_norm: float) -> None:
    """clip_grad_norm_ over DTensor (split) and plain (replicated norm) gradients together.

    torch's clip_grad_norm_ refuses a mix; without sequence parallelism the
    norms' weights stay plain tensors.
    """
    import torch
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import get_total_norm

    grads = [p.grad for p in parameters if p.grad is not None]
    split = [g for g in grads if isinstance(g, DTensor)]
    whole = [g for g in grads if not isinstance(g, DTensor)]
    squares = torch.zeros(())
    if split:
        squares += get_total_norm(split).full_tensor() ** 2
    if whole:
        squares += get_total_norm(whole) ** 2
    factor = min(1.0, max_norm / (float(squares.sqrt()) + 1e-6))
    for g in grads:
        g.mul_(factor)


def tp_worker(args) -> dict[str, float]:
    """ptc and torch tensor parallelism, without and with sequence parallelism, on this rank."""
    import torch
    import torch.distributed as dist

    from ptc.runtime.mesh import init_distributed

    torch.set_num_threads(1)
    init_distributed(make_tp_plan(args, False))
    result = {}
    for sp in (False, True):
        name = "tp2+sp" if sp else "tp2"
        result[f"ptc {name}"] = ptc_tp_step_time(args, sp)
        result[f"torch {name}"] = torch_tp_step_time(args, sp)
    dist.destroy_process_group()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="gpt", choices=("gpt", "llama"))
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--pp-layers", type=int, default=8,
                        help="layers of the pipeline benchmark's model (4 stages)")
    parser.add_argument("--dp", action=argparse.BooleanOptionalAction, default=True,
                        help="compare data parallelism (2 processes)")
    parser.add_argument("--pp", action=argparse.BooleanOptionalAction, default=True,
                        help="compare pipeline parallelism (4 processes)")
    parser.add_argument("--tp-hidden", type=int, default=128,
                        help="hidden size of the tensor-parallel benchmark's Llama")
    parser.add_argument("--tp", action=argparse.BooleanOptionalAction, default=True,
                        help="compare tensor parallelism (2 processes)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="also compare data parallelism with torch.compile on both sides "
                             "(ptc: runtime.compile; torch: DDP of the compiled model)")
    args = parser.parse_args()

    from ptc.runtime.launcher import run_local

    if args.tp:
        times = run_local(tp_worker, TP, args)[0]
        print(f"llama h={args.tp_hidden} layers={args.layers} seq={args.seq} "
              f"micro_batch={args.micro_batch} accum={args.accum}, tp={TP} gloo processes, "
              f"median of {args.repeat} steps")
        for name in ("tp2", "tp2+sp"):
            ours, theirs = times[f"ptc {name}"], times[f"torch {name}"]
            print(f"  {'ptc ' + name:16s} {ours * 1e3:8.2f} ms   {'torch ' + name:16s} "
                  f"{theirs * 1e3:8.2f} ms   ptc / torch = {ours / theirs:.2f}")

    if args.pp:
        times = run_local(pp_worker, PP_STAGES, args)[0]
        print(f"gpt (untied) h={args.hidden} layers={args.pp_layers} seq={args.seq} "
              f"micro_batch={args.micro_batch}, 1F1B over {PP_STAGES} stages (gloo processes), "
              f"{PP_MICROBATCHES} micro-batches, same stage split, median of {args.repeat} steps")
        print(f"  {'ptc pp':16s} {times['ptc'] * 1e3:8.2f} ms   {'torch pipelining':16s} "
              f"{times['torch'] * 1e3:8.2f} ms   ptc / torch = {times['ptc'] / times['torch']:.2f}")
    if not args.dp:
        return
    times = run_local(worker, NPROC, args)[0]
    print(f"{args.family} h={args.hidden} layers={args.layers} seq={args.seq} "
          f"micro_batch={args.micro_batch} accum={args.accum}, {NPROC} gloo processes, "
          f"median of {args.repeat} steps")
    pairs = [("ptc dp (zero 0)", "torch DDP"), ("ptc zero 3", "torch FSDP2")]
    if args.compile:
        pairs.append(("ptc dp compiled", "torch DDP compiled"))
    for ours, theirs in pairs:
        print(f"  {ours:16s} {times[ours] * 1e3:8.2f} ms   {theirs:18s} "
              f"{times[theirs] * 1e3:8.2f} ms   ptc / torch = {times[ours] / times[theirs]:.2f}")


if __name__ == "__main__":
    main()
