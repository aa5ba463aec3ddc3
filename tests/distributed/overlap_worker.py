"""Worker of test_overlap_order: train with overlap and log every collective each rank issues."""

from __future__ import annotations

import dataclasses

from dist_helpers import MODELS, tiny_plan


def bucketed_plan(zero: int, dp: int, overlap: bool = True):
    """The tiny GPT at `zero` over dp, 2 micro-batches, automatic bucket size (at most a layer)."""
    plan = tiny_plan("gpt", zero=zero, dp=dp, accum=2, steps=2, overlap=overlap)
    return dataclasses.replace(plan, parallel=dataclasses.replace(plan.parallel,
                                                                  bucket_size="auto"))


def log_collectives(zeros: list[int], dp: int) -> dict:
    """Worker: per ZeRO stage, train 2 steps recording collectives; rank 0 gets every log."""
    import torch.distributed as dist

    from ptc.lower.driver import compile_plan
    from ptc.ops.comm import record_collectives
    from ptc.runtime.executor import Trainer
    from ptc.runtime.mesh import axis_process_groups, build_mesh, init_distributed

    results = {}
    for zero in zeros:
        plan = bucketed_plan(zero, dp)
        init_distributed(plan)
        trainer = Trainer(compile_plan(plan), axis_process_groups(build_mesh(plan)), models=MODELS)
        with record_collectives() as log:
            for k in range(plan.train.steps):
                trainer.train_step(k)
        logs = [None] * dist.get_world_size()
        dist.all_gather_object(logs, list(log))
        if dist.get_rank() == 0:
            numels = [sum(trainer.units[u].spec.padded_numel for u in bucket)
                      for bucket in trainer.chunks[0].overlap.buckets]
            results[zero] = {"logs": logs, "buckets": trainer.chunks[0].overlap.buckets,
                             "bucket_numels": numels, "units": len(trainer.units)}
    dist.destroy_process_group()
    return results
