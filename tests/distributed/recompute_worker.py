"""Worker of test_recompute_equivalence: train tiny plans with activation checkpointing."""

from __future__ import annotations

import dataclasses

from dist_helpers import tiny_plan


def checkpointed_plan(family: str, zero: int, dp: int, checkpoint="full"):
    """The tiny plan of dist_helpers with `checkpoint` set."""
    plan = tiny_plan(family, zero=zero, dp=dp, accum=1)
    return dataclasses.replace(plan, parallel=dataclasses.replace(plan.parallel,
                                                                  checkpoint=checkpoint))


def run_checkpointed(cases: list[tuple], dp: int) -> dict:
    """Worker: train every (family, zero) case with checkpoint = full; rank 0 returns results."""
    import torch.distributed as dist

    from ptc.compiler.pipeline import compile_plan
    from ptc.runtime.executor import Trainer
    from ptc.runtime.mesh import axis_groups, build_mesh, init_distributed

    results = {}
    for family, zero in cases:
        plan = checkpointed_plan(family, zero, dp)
        init_distributed(plan)
        program = compile_plan(plan)
        trainer = Trainer(program, axis_groups(build_mesh(plan)))
        losses = [trainer.train_step(k).loss for k in range(plan.train.steps)]
        state = trainer.full_state_dict()
        if dist.get_rank() == 0:
            results[(family, zero)] = {"losses": losses, "state": state, "log": program.pass_log}
    dist.destroy_process_group()
    return results
