"""Worker of the optimizer-offload tests that records the weights each step's forward reads.

Runs in processes started by `run_local`, which import this
module afresh: it must be importable.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from dist_helpers import MODELS, tiny_plan
from pp_helpers import Case, pp_plan

from ptc.plan import Plan

READ_STEPS = 3


@dataclasses.dataclass(frozen=True)
class ReadCase:
    """A tiny layout trained with or without offload; `waits = False` turns the device-side
    waits for sent weights into no-ops (the control: a forward that does not wait)."""

    zero: int
    dtype: str = "fp32"
    pp: int = 1
    offload: str = "optimizer"
    waits: bool = True

    def __str__(self) -> str:
        pp = f"pp{self.pp} " if self.pp > 1 else ""
        wait = "" if self.waits else " without waits"
        return f"{pp}zero{self.zero} {self.dtype} offload={self.offload}{wait}"


def read_plan(case: ReadCase) -> Plan:
    """dp = 2; pp = 2 is the tiny 4-layer GPT (weights tied across the stages) under 1F1B."""
    if case.pp > 1:
        base = pp_plan(Case("gpt", case.pp, "1f1b", 2, dp=2, zero=case.zero), steps=READ_STEPS)
    else:
        base = tiny_plan("llama", zero=case.zero, dp=2, accum=2, steps=READ_STEPS)
    return dataclasses.replace(
        base, parallel=dataclasses.replace(base.parallel, offload=case.offload),
        train=dataclasses.replace(base.train, dtype=case.dtype))


@contextlib.contextmanager
def recording(trainer, reads: dict):
    """Record into reads[step][name] the weights the first forward of each stage graph reads
    in each step: the graph's parameters (ZeRO 0-2) or what its gathers return (ZeRO-3)."""
    from ptc.ops.collectives import GatherHandle

    now: dict = {"step": None, "into": None}
    names = {}  # shard storage address -> "stage.unit"
    for s, chunk in trainer.chunks.items():
        for unit in chunk.units:
            shard = unit.shard if unit.shard is not None else unit.master
            names[shard.data_ptr()] = f"{s}.{unit.spec.name}"
    wait = GatherHandle.wait

    def recorded_wait(handle):
        flats = wait(handle)
        if now["into"] is not None:
            for shard, flat in zip(handle.shards, flats):
                now["into"][names[shard.data_ptr()]] = flat.detach().clone()
        return flats

    for s, chunk in trainer.chunks.items():
        def run(*args, _run=chunk.runner.run, _s=s, _gm=chunk.gm):
            step = reads.setdefault(now["step"], {})
            if any(key.startswith(f"{_s}.") for key in step):
                return _run(*args)  # not the stage's first forward of the step
            if trainer.zero < 3:
                step.update({f"{_s}.{name}": p.detach().clone()
                             for name, p in _gm.named_parameters()})
                return _run(*args)
            now["into"] = step
            try:
                return _run(*args)
            finally:
                now["into"] = None
        chunk.runner.run = run
    GatherHandle.wait = recorded_wait
    try:
        yield now
    finally:
        GatherHandle.wait = wait


def read_weights_worker(cases: list[ReadCase]) -> dict:
    """Train every case; rank 0 returns its losses and the weights read per step, and
    every rank says whether what it read equals across cases (compared by the test)."""
    import torch.distributed as dist

    from ptc.lower.driver import compile_plan
    from ptc.runtime.executor import Trainer
    from ptc.runtime.host_copies import Landing
    from ptc.runtime.mesh import axis_process_groups, build_mesh, init_distributed

    results = {}
    for case in cases:
        plan = read_plan(case)
        init_distributed(plan)
        trainer = Trainer(compile_plan(plan), axis_process_groups(build_mesh(plan)), models=MODELS)
        reads: dict = {}
        wait_device = Landing.wait_device
        if not case.waits:
            Landing.wait_device = lambda self: None
        try:
            with recording(trainer, reads) as now:
                losses = []
                for k in range(plan.train.steps):
                    now["step"] = k
                    losses.append(trainer.train_step(k).loss)
        finally:
            Landing.wait_device = wait_device
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, reads)
        if dist.get_rank() == 0:
            results[case] = {"losses": losses, "reads": everyone}
    dist.destroy_process_group()
    return results


def same_reads(a: list[dict], b: list[dict]) -> list[str]:
    """Where two runs' recorded reads differ: "rank r step k name" for every mismatch."""
    out = []
    for rank, (mine, theirs) in enumerate(zip(a, b)):
        assert mine.keys() == theirs.keys()
        for step in mine:
            assert mine[step].keys() == theirs[step].keys(), (rank, step)
            out += [f"rank {rank} step {step + 1} {name}" for name, value in mine[step].items()
                    if not torch.equal(value, theirs[step][name])]
    return out
