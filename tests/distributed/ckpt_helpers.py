"""Workers and plans of the checkpoint and fault-injection tests.

Workers run in processes started by `run_local`, which import this module
afresh: it must be importable. Plans are tiny (2 layers, hidden 32, seq 16) with a
global batch of 8 samples, so that dp 1, 2 and 4 all divide it.
"""

from __future__ import annotations

import dataclasses
import os
import resource
from collections.abc import Callable

import torch
import torch.distributed as dist
from dist_helpers import MODELS, SEQ, tiny_model

from ptc.plan import (
    DataSpec,
    HardwareSpec,
    InitSpec,
    LRScheduleSpec,
    OptimizerSpec,
    ParallelSpec,
    Plan,
    RuntimeSpec,
    TrainSpec,
)

GLOBAL_BATCH = 8


def ckpt_plan(*, dp: int, zero: int, steps: int = 6, family: str = "llama", tp: int = 1,
              pp: int = 1, **runtime) -> Plan:
    """The tiny model on tp·pp·dp CPU ranks; `runtime` overrides RuntimeSpec fields (gloo)."""
    return Plan(
        model=tiny_model(family),
        hardware=HardwareSpec.preset("cpu", gpus_per_node=tp * pp * dp),
        parallel=ParallelSpec(tp=tp, pp=pp, dp=dp, zero=zero),
        train=TrainSpec(seq_len=SEQ, global_batch=GLOBAL_BATCH, micro_batch=1, dtype="fp32",
                        steps=steps, grad_clip=1.0,
                        optimizer=OptimizerSpec(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1),
                        # decay_steps fixed: a resumed run with more steps keeps the schedule
                        lr_schedule=LRScheduleSpec(kind="cosine", warmup=2, min_lr=3e-4,
                                                   decay_steps=8),
                        data=DataSpec(kind="synthetic", seed=7),
                        init=InitSpec(kind="random", seed=3)),
        runtime=RuntimeSpec(backend="gloo", **runtime),
    )


def with_runtime(plan: Plan, **runtime) -> Plan:
    """`plan` with RuntimeSpec fields replaced."""
    return dataclasses.replace(plan, runtime=dataclasses.replace(plan.runtime, **runtime))


def _trainer(plan: Plan, module: Callable[[], torch.nn.Module] | None = None):
    """This rank's Trainer of `plan` (its ep groups too); `module()`, when given, builds the
    user's module the plan compiles instead of its model (every rank the same weights)."""
    from ptc.lower.driver import compile_plan
    from ptc.runtime.executor import Trainer
    from ptc.runtime.mesh import axis_process_groups, build_mesh, init_distributed

    init_distributed(plan)
    program = compile_plan(plan, model=None if module is None else module())
    return Trainer(program, axis_process_groups(build_mesh(plan), plan.parallel.ep),
                   models=MODELS)


def _checkpointer(trainer, directory: str):
    from ptc.runtime.checkpoint import Checkpointer, checkpoint_group
    from ptc.runtime.checkpoint_store import CheckpointStore
    from ptc.runtime.mesh import timeout

    runtime = trainer.plan.runtime
    return Checkpointer(trainer, CheckpointStore(directory), group=checkpoint_group(timeout()),
                        keep=runtime.keep, async_save=runtime.async_save, log=lambda _: None)


def full_state(trainer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor, full and by name, on every rank (collective).

    Each unit's shards are gathered over its own group (an expert unit's: the ranks holding
    the same experts), then the expert stacks joined over ep, then the tp slices over tp."""
    from ptc.runtime.checkpoint import (
        ensure_optimizer_state,
        full_name,
        optimizer_kinds,
    )
    from ptc.ops.comm import all_gather_flat
    from ptc.runtime.tp_state import join_over_tp

    ensure_optimizer_state(trainer)
    kinds = ("model", *optimizer_kinds(trainer))
    local: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in kinds}
    for unit in trainer.units:
        state = trainer.optimizer.inner.state[unit.master]
        for kind in kinds:
            flat = unit.master.detach() if kind == "model" else state[kind]
            full = flat if trainer.zero == 0 else all_gather_flat(flat.contiguous(),
                                                                  unit.group).wait()
            for slot in unit.slots:
                local[kind].setdefault(full_name(trainer, slot), full[
                    slot.offset:slot.offset + slot.numel].view(slot.shape).clone())
    out = {"step": state["step"].clone()}
    tp, experts = trainer.program.tensor_parallel, trainer.program.decisions.expert_parallel
    for kind, values in local.items():
        if experts is not None:  # each ep rank's experts (tp-local), then the tp slices
            values = join_over_tp(values, experts, trainer.ep_group)
        if tp is not None:
            values = join_over_tp(values, tp, trainer.tp_group)
        out.update({f"{kind}.{name}": value for name, value in values.items()})
    if trainer.plan.parallel.pp > 1:  # every stage's parameters
        parts = [None] * trainer.plan.parallel.pp
        dist.all_gather_object(parts, out, group=trainer.pp_group)
        out = {name: value for part in parts for name, value in part.items()}
    return out


def save_worker(plan: Plan, directory: str, steps: int, more: int,
                module: Callable[[], torch.nn.Module] | None = None) -> dict:
    """Train `steps`, checkpoint, record everything, train `more` steps uninterrupted
    (`module`: as `_trainer`'s)."""
    trainer = _trainer(plan, module)
    losses = [trainer.train_step(k).loss for k in range(steps)]
    state = full_state(trainer)
    checkpointer = _checkpointer(trainer, directory)
    checkpointer.save(steps, steps * GLOBAL_BATCH, {"layout": layout(plan)})
    # Training goes on while the save is in flight: it must not change what is saved.
    after = [trainer.train_step(k).loss for k in range(steps, steps + more)]
    checkpointer.close()
    result = {"losses": losses, "state": state, "after": after}
    dist.destroy_process_group()
    return result


def layout(plan: Plan) -> dict[str, int]:
    """The layout a checkpoint's manifest records."""
    p = plan.parallel
    ep = {"ep": p.ep} if p.ep != 1 else {}
    return {"tp": p.tp, "pp": p.pp, "dp": p.dp, **ep, "zero": p.zero}


def load_worker(jobs: list[tuple[Plan, str]], more: int, save_to: list[str] | None = None,
                module: Callable[[], torch.nn.Module] | None = None) -> list[dict]:
    """Per (plan, directory): restore, record the state, train `more` steps.

    With `save_to`, then checkpoint into save_to[i], record the state saved and the
    losses of `more` further steps. `module`: as `_trainer`'s.
    """
    out = []
    for index, (plan, directory) in enumerate(jobs):
        trainer = _trainer(plan, module)
        manifest = _checkpointer(trainer, directory).restore()
        assert manifest.position == manifest.step * GLOBAL_BATCH
        got = {"state": full_state(trainer), "step": manifest.step,
               "position": manifest.position,
               "after": [trainer.train_step(manifest.step + k).loss for k in range(more)]}
        if save_to is not None:  # and the uninterrupted run after that checkpoint
            step = manifest.step + more
            checkpointer = _checkpointer(trainer, save_to[index])
            checkpointer.save(step, step * GLOBAL_BATCH, {"layout": layout(plan)})
            checkpointer.close()
            got["saved"] = full_state(trainer)
            got["saved_after"] = [trainer.train_step(step + k).loss for k in range(more)]
        out.append(got)
    dist.destroy_process_group()
    return out


def run_worker(plans: list[Plan], fault: str | None = None) -> list[dict]:
    """Train each plan through the production loop; per plan: events, losses, error, weights."""
    from ptc.runtime import faults
    from ptc.runtime.mesh import init_distributed
    from ptc.lower.driver import compile_plan
    from ptc.runtime.train import train_worker

    if fault is not None:
        os.environ[faults.ENV] = fault
    out = []
    for plan in plans:
        faults._fired.clear()  # each plan meets the fault afresh
        init_distributed(plan)
        try:
            result = train_worker(plan, compiler=compile_plan, models=MODELS)
            out.append({"events": result.events, "losses": result.losses,
                        "nonfinite": [s.nonfinite for s in result.steps], "error": None})
        except Exception as exc:  # noqa: BLE001 - the test compares errors across ranks
            out.append({"events": [], "losses": [], "nonfinite": [], "error": str(exc)})
    dist.destroy_process_group()
    return out


def guard_worker(plan: Plan, fault: str) -> dict:
    """Train `plan`'s steps on the Trainer under the `PTC_FAULT` `fault`, logging per step its
    stats and the elements of every `torch.distributed.all_reduce` it issues; and the
    elements of each gradient bucket."""
    from ptc.runtime import faults

    os.environ[faults.ENV] = fault
    faults._fired.clear()
    trainer = _trainer(plan)
    issued: list[int] = []
    real = dist.all_reduce

    def logged(tensor, *args, **kwargs):
        issued.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = logged
    try:
        steps = []
        for k in range(plan.train.steps):
            issued.clear()
            stats = trainer.train_step(k)
            steps.append({"nonfinite": stats.nonfinite, "loss": stats.loss,
                          "all_reduce": list(issued)})
    finally:
        dist.all_reduce = real
    buckets = [sum(trainer.units[u].spec.padded_numel for u in bucket)
               for chunk in trainer.chunks.values() for bucket in chunk.overlap.buckets]
    dist.destroy_process_group()
    return {"steps": steps, "buckets": buckets}


def rss_bytes() -> int:
    """This process's resident set size now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def async_save_worker(plan: Plan, directory: str, saves: int) -> dict:
    """Alternate a training step and an async save `saves` times, measuring RSS after each;
    then poison one weight and try once more: that save must be refused."""
    trainer = _trainer(plan)
    checkpointer = _checkpointer(trainer, directory)
    rss = []
    for k in range(saves):
        trainer.train_step(k)
        checkpointer.save(k + 1, (k + 1) * plan.train.global_batch, {"layout": {}})
        checkpointer.wait()
        rss.append(rss_bytes())
    trainer.units[0].master.detach().view(-1)[0] = float("inf")
    refused = not checkpointer.save(saves + 1, 0, {"layout": {}})
    checkpointer.close()
    dist.destroy_process_group()
    return {"rss": rss, "state_bytes": sum(4 * 3 * u.master.numel() for u in trainer.units),
            "refused": refused}


def damage(directory: str, how: str) -> None:
    """Damage the newest checkpoint: flip a byte of a shard file, or truncate DCP's index."""
    from ptc.runtime.checkpoint_store import CheckpointStore

    store = CheckpointStore(directory)
    path = store.path(store.latest())
    if how == "corrupt":
        shard = next(p for p in sorted(path.iterdir()) if p.suffix == ".distcp")
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    else:
        index = path / ".metadata"
        index.write_bytes(index.read_bytes()[: index.stat().st_size // 2])
    store.partial_path(store.latest() + 2).mkdir()  # and a save that never finished


def damage_worker(plans: list[Plan], hows: list[str], steps: int) -> list[dict]:
    """Per plan: train, damage the newest checkpoint (rank 0), resume up to `steps`."""
    from ptc.runtime.mesh import init_distributed
    from ptc.lower.driver import compile_plan
    from ptc.runtime.train import train_worker

    out = []
    for plan, how in zip(plans, hows):
        init_distributed(plan)
        train_worker(plan, compiler=compile_plan, models=MODELS)
        if dist.get_rank() == 0:
            damage(plan.runtime.checkpoint_dir, how)
        dist.barrier()
        result = train_worker(dataclasses.replace(
            plan, train=dataclasses.replace(plan.train, steps=steps)), compiler=compile_plan,
            models=MODELS)
        out.append({"events": result.events, "losses": result.losses})
    dist.destroy_process_group()
    return out


def assert_restored(got: dict, step: int, state: dict, what: str) -> None:
    """A load resumed at `step` and its data position, with exactly the saved `state`."""
    assert (got["step"], got["position"]) == (step, step * GLOBAL_BATCH), what
    assert got["state"].keys() == state.keys(), what
    for name, value in state.items():
        assert torch.equal(got["state"][name], value), f"{what}: {name} differs"
