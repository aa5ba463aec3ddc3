"""Worker of the float8 compute tests: the tiny models trained under `train.dtype = fp8`
(emulated) and bf16, with and without tp. Importable, for the started processes."""

from __future__ import annotations

import dataclasses

from dist_helpers import train_cases
from tp_helpers import TPCase, tp_plan

from ptc.plan import Plan


def fp8_plan(case: tuple) -> Plan:
    """(family, tp, dtype, fp8 scaling[, "sp"]): the tp test's plan of the tiny model, in
    `dtype` (fp8 emulated) on one sample-pair micro-batch, with sequence parallelism when
    the case says "sp"."""
    family, tp, dtype, scaling, *sp = case
    plan = tp_plan(TPCase(family, tp, sp=sp == ["sp"]))
    return dataclasses.replace(plan, train=dataclasses.replace(
        plan.train, dtype=dtype, fp8_scaling=scaling, fp8_emulate=True))


def run_fp8_cases(cases: list[tuple]) -> dict:
    """Worker: train every case (`dist_helpers.train_cases`)."""
    return train_cases(cases, fp8_plan)


def fp8_ckpt_plan(*, tp: int, dp: int, steps: int, pp: int = 1) -> Plan:
    """The checkpoint tests' tiny Llama at ZeRO-1 in fp8 (emulated, delayed scaling)."""
    from ckpt_helpers import ckpt_plan

    plan = ckpt_plan(dp=dp, zero=1, tp=tp, pp=pp, steps=steps)
    return dataclasses.replace(plan, train=dataclasses.replace(
        plan.train, dtype="fp8", fp8_scaling="delayed", fp8_emulate=True))


def _histories(trainer) -> dict:
    """Every rank's (tp rank, dp rank, {linear: history}) (collective; on every rank)."""
    import torch.distributed as dist

    from ptc.runtime.fp8_state import scalings

    mine = (trainer.tp_rank, trainer.dp_rank,
            {name: s.saved_history(trainer.device).clone() for name, s in scalings(trainer).items()})
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def fp8_resume_worker(directory: str, steps: int) -> dict:
    """tp 2 x dp 2: train 2·steps uninterrupted, checkpointing after `steps`; then resume from
    that checkpoint and train the rest, and once more with the histories emptied after the
    restore (the control). Rank 0 returns losses, full states and the saved histories."""
    import torch.distributed as dist
    from ckpt_helpers import _checkpointer, _trainer, full_state, layout

    plan = fp8_ckpt_plan(tp=2, dp=2, steps=2 * steps)
    trainer = _trainer(plan)
    losses = [trainer.train_step(k).loss for k in range(steps)]
    checkpointer = _checkpointer(trainer, directory)
    checkpointer.save(steps, steps * plan.train.global_batch, {"layout": layout(plan)})
    checkpointer.close()
    saved = _histories(trainer)
    losses += [trainer.train_step(k).loss for k in range(steps, 2 * steps)]
    out = {"uninterrupted": {"losses": losses, "state": full_state(trainer)}, "saved": saved}
    for name, forget in (("resumed", False), ("fresh history", True)):
        trainer = _trainer(plan)
        manifest = _checkpointer(trainer, directory).restore()
        if forget:
            from ptc.runtime.fp8_state import scalings

            for state in scalings(trainer).values():
                state.history = state.pending = None
        restored = _histories(trainer)
        losses = [trainer.train_step(k).loss for k in range(manifest.step, 2 * steps)]
        out[name] = {"losses": losses, "state": full_state(trainer), "restored": restored}
    dist.destroy_process_group()
    return out


def fp8_reshard_worker(jobs: list[tuple[int, int, int]], directory: str) -> dict:
    """Per (tp, pp, dp): restore the tp 2 x dp 2 checkpoint; every rank's restored histories."""
    import torch.distributed as dist
    from ckpt_helpers import _checkpointer, _trainer

    out = {}
    for tp, pp, dp in jobs:
        trainer = _trainer(fp8_ckpt_plan(tp=tp, pp=pp, dp=dp, steps=1))
        _checkpointer(trainer, directory).restore()
        out[(tp, pp, dp)] = _histories(trainer)
        dist.destroy_process_group()
    return out


def fp8_pp_plan(case: tuple[str, int, str, str, int]) -> Plan:
    """(family, pp, schedule, fp8 scaling, virtual stages): the pipeline tests' 4-layer tiny
    model, 4 micro-batches of one sample, in fp8 (emulated)."""
    from pp_helpers import Case, pp_plan

    family, pp, schedule, scaling, virtual = case
    plan = pp_plan(Case(family, pp, schedule, 4, virtual=virtual))
    return dataclasses.replace(plan, train=dataclasses.replace(
        plan.train, dtype="fp8", fp8_scaling=scaling, fp8_emulate=True))


def run_fp8_pp_cases(cases: list[tuple[str, int, str, str, int]]) -> dict:
    """Worker: train every pipeline case (`dist_helpers.train_cases`)."""
    return train_cases(cases, fp8_pp_plan)
