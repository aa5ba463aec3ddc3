"""Training a plan or a compiled Program: in this process, or on launched processes.

`run(plan_or_program, models=..., preflight=..., compiler=...)` is the Python
entry (`ptc.run`).
Inside a launched worker (torchrun, `ptc run`), or when the plan needs one
process, the training runs here; otherwise `run` starts the plan's
processes with PyTorch's elastic launcher and returns rank 0's result.
`train_worker` is what each process runs: join the process group, build
the mesh, compile the plan with the `compiler` it was handed (every rank
compiles the same Program; the runtime itself never imports the passes),
build the model and its initial weights with the `ModelFactory` it was handed,
then `TrainLoop` resumes from the latest checkpoint, trains and checkpoints,
and the reporter records every step. In an elastic job (`ptc run --nnodes
MIN:MAX`) the plan's dp first adapts to the processes that joined. What
`run` checks before it starts processes (`preflight`) is handed in too:
checking a plan is planning, not running.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist
from torch import nn

from ptc.compiler.records.program import Program
from ptc.errors import Diagnostic, PlanError, PtcError
from ptc.plan import Plan
from ptc.runtime.elastic import elastic, plan_for_world
from ptc.runtime.executor import StepStats, Trainer
from ptc.runtime.health import configure_flight_recorder
from ptc.runtime.init import ModelFactory, check_buffers, tensor_bytes
from ptc.runtime.launcher import die_with_parent, in_worker, refuse_while_spawning, run_local
from ptc.runtime.loop import TrainLoop
from ptc.runtime.mesh import (
    axis_process_groups,
    backend_for,
    build_mesh,
    device_for,
    init_distributed,
    world_size,
)
from ptc.runtime.metrics import StepReporter, model_flops_per_step, run_banner


@dataclass
class RunResult:
    """What a training run did, as rank 0 saw it."""

    steps: list[StepStats] = field(default_factory=list)
    """Every step's statistics."""
    held_bytes: dict[str, int] = field(default_factory=dict)
    """Parameter, gradient and optimizer bytes this rank held after the last step."""
    events: list[str] = field(default_factory=list)
    """What the run reported besides steps: resume, checkpoints, skipped or rolled-back steps."""

    @property
    def losses(self) -> list[float]:
        """The loss of every step."""
        return [s.loss for s in self.steps]


Compiler = Callable[..., Program]
"""What turns a plan (and optionally the user's `model=`) into a Program
(`ptc.lower.driver.compile_plan`), handed in from above."""

Preflight = Callable[..., list[Diagnostic]]
"""What finds, before any process starts, the problems a run would meet
(`ptc.lower.preflight.preflight`), handed in from above."""


def train_worker(plan_or_program: Plan | Program, *, models: ModelFactory,
                 compiler: Compiler | None = None, steps: int | None = None,
                 model: nn.Module | None = None) -> RunResult:
    """Run the training as one process of the job (collective with the other ranks).

    A Plan is compiled here, after the process group is up, with `compiler`,
    from `model` when given (the module the Program `run` was handed came from);
    `models` builds the plan's own model and its initial weights.
    """
    plan = plan_or_program.plan if isinstance(plan_or_program, Program) else plan_or_program
    if in_worker():
        die_with_parent()
    joined = int(os.environ.get("WORLD_SIZE", world_size(plan)))
    asked = plan.parallel.dp
    if elastic() and isinstance(plan_or_program, Plan):
        plan = plan_or_program = plan_for_world(plan, joined)
    if plan.runtime.checkpoint_dir and backend_for(plan) == "nccl":
        configure_flight_recorder(Path(plan.runtime.checkpoint_dir) / "traces")
    created = init_distributed(plan)
    try:
        if isinstance(plan_or_program, Program):
            program = plan_or_program
        elif compiler is None:
            raise TypeError("train_worker of a Plan needs the compiler that lowers it")
        else:
            program = compiler(plan) if model is None else compiler(plan, model=model)
        groups = axis_process_groups(build_mesh(plan), plan.parallel.ep)
        trainer = Trainer(program, groups, models=models, device=device_for(plan))
        steps = steps if steps is not None else plan.train.steps
        loop = TrainLoop(trainer, steps)
        if plan.parallel.dp != asked:
            loop.log(f"elastic job: {joined} processes joined, so dp = {plan.parallel.dp} "
                     f"(the plan asks {asked}); the global batch is unchanged")
        result = RunResult(events=loop.events)
        with StepReporter(plan, steps=steps, enabled=dist.get_rank() == 0,
                          predicted_step_time=program.predicted_step_time,
                          flops_per_step=model_flops_per_step(program),
                          append=loop.resumed_from is not None,
                          banner=run_banner(program)) as reporter:
            def report(stats: StepStats) -> None:
                reporter.report(stats)
                result.steps.append(stats)

            loop.run(report)
        result.held_bytes = trainer.held_bytes()
        return result
    finally:
        if created:
            dist.destroy_process_group()


def run(plan_or_program: Plan | Program, *, models: ModelFactory, preflight: Preflight,
        compiler: Compiler | None = None, steps: int | None = None,
        allow_oom: bool = False) -> RunResult:
    """Train a plan (compiling it) or a compiled Program; return rank 0's RunResult.

    From a plain Python process, a plan for several processes is checked
    (`preflight`) and run on local processes started by the elastic launcher
    (one per rank), each compiling the plan itself; inside a launched worker,
    or for a one-process plan, it runs right here (on the given Program).
    """
    refuse_while_spawning()
    plan = plan_or_program.plan if isinstance(plan_or_program, Program) else plan_or_program
    if in_worker() or dist.is_initialized() or world_size(plan) == 1:
        return train_worker(plan_or_program, models=models, compiler=compiler, steps=steps)
    # Workers get the plan, and the user's module when the Program came from one, and
    # compile again: compiling is deterministic, and a GraphModule may not pickle.
    program = plan_or_program if isinstance(plan_or_program, Program) else None
    vocab = program.vocab if program is not None else plan.model.vocab
    module = program.model if program is not None else None
    found = [d for d in preflight(plan, allow_oom=allow_oom, vocab=vocab,
                                  factory=module is None,
                                  module_priced=program is not None
                                  and program.decisions.estimate is not None,
                                  compiler=compiler if program is None else None,
                                  sent_bytes=tensor_bytes(module, meta=False) if module is not None
                                  else 0)
             if d.severity == "error"]
    if found:
        raise PlanError(found)
    if program is None or program.model is None:
        return run_local(train_worker, world_size(plan), plan, models=models,
                         compiler=compiler, steps=steps)[0]
    _check_buffers(program)
    return run_local(_train_received, world_size(plan), plan,
                     _pickled(program.model, world_size(plan)), models=models,
                     compiler=compiler, steps=steps)[0]


def _check_buffers(program: Program) -> None:
    """PtcError, before any process starts, when a buffer of the module the Program was
    compiled from has no value the workers could give it (`init.check_buffers`: a module
    built on the meta device whose buffer is in no state dict and has no reset_buffers()):
    each worker would fail on it."""
    if any(b.is_meta for b in program.model.buffers()):
        for stage in program.stages:
            check_buffers(stage.graph, program.plan, program.model)


def _train_received(plan: Plan, pickled: bytes, **kwargs) -> RunResult:
    """`train_worker` of the module `_pickled` sent (pickled once, in the parent)."""
    return train_worker(plan, model=pickle.loads(pickled), **kwargs)


def _pickled(model: nn.Module, nproc: int) -> bytes:
    """`model` pickled for the spawned workers; PtcError, before any process starts, when
    it cannot travel."""
    try:
        return pickle.dumps(model)
    except Exception as exc:  # pickle raises PicklingError, AttributeError, TypeError, ...
        raise PtcError(
            f"ptc.run: the module given to ptc.compile ({type(model).__qualname__}) cannot be "
            f"sent to the {nproc} worker processes: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}; define its class at module level "
            f"of an importable file, or name it in the plan (model {{ family = custom, factory "
            f"= \"package.module:factory\" }}), or start the script under torchrun") from None
