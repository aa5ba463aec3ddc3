"""Training a plan or a compiled Program: in this process, or on launched processes.

`run(plan_or_program)` is the Python entry (`ptc.run`, `Program.run`).
Inside a launched worker (torchrun, `ptc run`), or when the plan needs one
process, the training runs here; otherwise `run` starts the plan's
processes with PyTorch's elastic launcher and returns rank 0's result.
`train_worker` is what each process runs: join the process group, build
the mesh, compile the plan (every rank compiles the same Program), train,
report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from ptc.compiler.program import Program
from ptc.plan import Plan
from ptc.runtime.executor import StepStats, Trainer
from ptc.runtime.launcher import in_worker, run_local
from ptc.runtime.mesh import axis_groups, build_mesh, device_for, init_distributed, world_size
from ptc.runtime.metrics import StepReporter
from ptc.runtime.pipeline_exec import PipelineTrainer


@dataclass
class RunResult:
    """What a training run did, as rank 0 saw it."""

    steps: list[StepStats] = field(default_factory=list)
    """Every step's statistics."""
    held_bytes: dict[str, int] = field(default_factory=dict)
    """Parameter, gradient and optimizer bytes this rank held after the last step."""

    @property
    def losses(self) -> list[float]:
        """The loss of every step."""
        return [s.loss for s in self.steps]


def train_worker(plan_or_program: Plan | Program, *, steps: int | None = None) -> RunResult:
    """Run the training as one process of the job (collective with the other ranks)."""
    plan = plan_or_program.plan if isinstance(plan_or_program, Program) else plan_or_program
    created = init_distributed(plan)
    try:
        if isinstance(plan_or_program, Program):
            program = plan_or_program
        else:
            from ptc.compiler.pipeline import compile_plan  # noqa: PLC0415

            program = compile_plan(plan)
        groups = axis_groups(build_mesh(plan))
        kind = PipelineTrainer if plan.parallel.pp > 1 else Trainer
        trainer = kind(program, groups, device=device_for(plan))
        steps = steps if steps is not None else plan.train.steps
        result = RunResult()
        with StepReporter(plan, steps=steps, enabled=dist.get_rank() == 0,
                          predicted_step_time=program.predicted_step_time) as reporter:
            for step in range(steps):
                stats = trainer.train_step(step)
                reporter.report(stats)
                result.steps.append(stats)
        result.held_bytes = trainer.held_bytes()
        return result
    finally:
        if created:
            dist.destroy_process_group()


def run(plan_or_program: Plan | Program, *, steps: int | None = None) -> RunResult:
    """Train a plan (compiling it) or a compiled Program; return rank 0's RunResult.

    From a plain Python process, a plan for several processes is run on
    local processes started by the elastic launcher (one per rank), each
    compiling the plan itself; inside a launched worker, or for a
    one-process plan, it runs right here (on the given Program).
    """
    plan = plan_or_program.plan if isinstance(plan_or_program, Program) else plan_or_program
    if in_worker() or dist.is_initialized() or world_size(plan) == 1:
        return train_worker(plan_or_program, steps=steps)
    # Workers get the plan and compile it again: compiling is deterministic, and the plan
    # travels to spawned processes where a GraphModule may not pickle.
    return run_local(train_worker, world_size(plan), plan, steps=steps)[0]
