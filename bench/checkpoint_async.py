"""What a checkpoint costs training: async (dcp.async_save) against sync (dcp.save).

One process (one GPU when there is one, else the CPU) trains a Llama-style
model for `--steps` steps three times from the same state: without
checkpoints, saving every `--every` steps synchronously, and saving every
`--every` steps asynchronously (ptc's default). Reported per mode:

- save step: median time of the steps that start a save, save call included
  (async: the copy to host memory; sync: the whole write);
- other steps: median time of the steps that do not;
- pause: save step - other steps, what training waits for per save;
- cost per save: (total time - total time without checkpoints) / saves,
  what a save really costs the run — for async it includes the slowdown of
  the steps that overlap the background write (on a 2-core CPU the writer
  competes with the training for the cores).

    python bench/checkpoint_async.py [--hidden 512] [--layers 4] [--vocab 8192]
                                     [--seq 64] [--batch 8] [--steps 24] [--every 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_plan(args, directory: str | None, async_save: bool):
    """The benchmark plan on one process."""
    from ptc.plan import (DataSpec, HardwareSpec, ModelSpec, OptimizerSpec, ParallelSpec, Plan,
                          RuntimeSpec, TrainSpec)

    model = ModelSpec(family="llama", layers=args.layers, hidden=args.hidden, heads=8,
                      kv_heads=8, ffn=4 * args.hidden, vocab=args.vocab, max_seq=args.seq)
    gpu = args.device == "cuda"
    return Plan(model=model, hardware=HardwareSpec.preset("H100-SXM" if gpu else "cpu",
                                                          gpus_per_node=1),
                parallel=ParallelSpec(dp=1, zero=0),
                train=TrainSpec(seq_len=args.seq, micro_batch=args.batch, global_batch=args.batch,
                                dtype="bf16" if gpu else "fp32", steps=args.steps,
                                optimizer=OptimizerSpec(lr=1e-4), data=DataSpec(seed=1)),
                runtime=RuntimeSpec(backend="nccl" if gpu else "gloo", checkpoint_dir=directory,
                                    checkpoint_every=args.every, keep=2, async_save=async_save))


def run_mode(args, mode: str) -> dict:
    """Train `args.steps` steps in one mode ("none", "sync", "async"); per-step seconds."""
    import torch

    from ptc.lower.driver import compile_plan
    from ptc.runtime.checkpoint import Checkpointer, checkpoint_group
    from ptc.runtime.checkpoint_store import CheckpointStore
    from ptc.runtime.executor import Trainer
    from ptc.worker import MODELS
    from ptc.runtime.mesh import axis_process_groups, build_mesh, device_for, init_distributed, timeout

    with tempfile.TemporaryDirectory() as directory:
        plan = make_plan(args, directory if mode != "none" else None, mode == "async")
        init_distributed(plan)
        trainer = Trainer(compile_plan(plan), axis_process_groups(build_mesh(plan)), models=MODELS,
                          device=device_for(plan))
        checkpointer = None if mode == "none" else Checkpointer(
            trainer, CheckpointStore(directory), group=checkpoint_group(timeout()), keep=2,
            async_save=mode == "async", log=lambda _: None)
        sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
        trainer.train_step(0)  # warm-up, untimed
        times, saves = [], []
        begin = time.perf_counter()
        for step in range(1, args.steps + 1):
            start = time.perf_counter()
            trainer.train_step(step)
            if checkpointer is not None and step % args.every == 0:
                checkpointer.save(step, step * plan.train.global_batch, {})
                saves.append(step - 1)
            sync()
            times.append(time.perf_counter() - start)
        if checkpointer is not None:
            checkpointer.close()
        total = time.perf_counter() - begin
        state = sum(12 * u.master.numel() for u in trainer.units)
    return {"times": times, "saves": saves, "total": total, "state": state}


def worker(args) -> dict:
    """Every mode in one process, in turn."""
    import torch.distributed as dist

    out = {mode: run_mode(args, mode) for mode in ("none", "sync", "async")}
    dist.destroy_process_group()
    return out


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    from ptc.runtime.launcher import run_local

    result = run_local(worker, 1, args)[0]
    base = result["none"]
    print(f"{args.device}: state {result['sync']['state'] / 2**20:.0f} MiB per save (fp32 "
          f"masters + Adam), {args.steps} steps, a save every {args.every}")
    print(f"{'mode':6} {'save step':>10} {'other steps':>12} {'pause':>10} {'total':>8} "
          f"{'cost per save':>14}")
    for mode in ("none", "sync", "async"):
        r = result[mode]
        saving = [t for k, t in enumerate(r["times"]) if k in r["saves"]]
        other = statistics.median([t for k, t in enumerate(r["times"]) if k not in r["saves"]])
        cost = (r["total"] - base["total"]) / len(r["saves"]) if r["saves"] else 0.0
        save_ms = f"{statistics.median(saving) * 1e3:.1f} ms" if saving else "-"
        pause = f"{(statistics.median(saving) - other) * 1e3:.1f} ms" if saving else "-"
        print(f"{mode:6} {save_ms:>10} {other * 1e3:>9.1f} ms {pause:>10} "
              f"{r['total']:>6.2f} s {cost * 1e3:>11.1f} ms")
    sync_cost = result["sync"]["total"] - base["total"]
    async_cost = result["async"]["total"] - base["total"]
    if sync_cost > 0:
        print(f"async / sync cost of checkpointing: {async_cost / sync_cost:.2f}")


if __name__ == "__main__":
    main()
