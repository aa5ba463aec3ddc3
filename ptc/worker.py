"""`python -m ptc.worker PLAN`: what each process `ptc run` starts runs.

`ptc run` reads the plan once, with its command-line overrides, checks it,
and writes it back as text with every path absolute into the run's log
folder, as plan/<the plan file's own name> (`write_plan`, handed to the
launcher); each worker reads that file, with no overrides, so every rank
trains the very plan the launching process checked, whatever folder it
starts in.

It sits above the runtime: it compiles the plan (`ptc.lower.driver`) and
hands the runtime the compiler and the built-in models (`MODELS`, from
`ptc.models`) as its model factory; the runtime imports neither.

`record` writes the exception of a failing rank to the file torchrun reads,
so the launcher reports that rank's message (rank, graph node, source line)
as the root cause.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from torch.distributed.elastic.multiprocessing.errors import record

from ptc.models import build_model, initial_value
from ptc.runtime.init import ModelFactory

if TYPE_CHECKING:
    from ptc.plan import Plan

PLAN_FOLDER = "plan"
"""The log folder's subfolder that holds the resolved plan (beside torchrun's and the
traces' own): never the folder of the user's plan file, which it would overwrite."""

UNNAMED_PLAN = "plan.ptc"
"""The resolved plan file's name for a plan that came from no file (built in Python)."""

MODELS = ModelFactory(build=build_model, initial_value=initial_value)
"""The built-in models as the runtime's model factory: what the workers of `ptc run` and
`ptc.run` hand the runtime to build a plan's model and its initial weights."""


def write_plan(plan: Plan, folder: Path) -> Path:
    """Write `plan` as plan text, every path in it absolute, into `folder`/plan and return
    the file: what the launched workers read. It keeps the name of the plan's own file,
    which names the run (`ptc.runtime.metrics.wandb_run_name`). Written beside and renamed
    into place, so a worker (or another node sharing the folder) never reads half a plan."""
    from ptc.dsl import dump_plan  # noqa: PLC0415
    from ptc.dsl.paths import absolute_paths  # noqa: PLC0415

    text = dump_plan(absolute_paths(plan))
    name = UNNAMED_PLAN if plan.source.startswith("<") else Path(plan.source).name
    path = folder / PLAN_FOLDER / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=f".{name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(partial, path)
    return path


@record
def main(argv: Sequence[str] | None = None) -> int:
    """Load the resolved plan file `ptc run` wrote and train it as this rank; return the
    exit code."""
    from ptc.dsl import load_plan  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="ptc.worker")
    parser.add_argument("plan", help="the resolved plan file `ptc run` wrote (.ptc)")
    args = parser.parse_args(argv)
    return _train(load_plan(args.plan))


@record
def train(plan: Plan) -> int:
    """Train `plan` as this rank of a job torchrun started (`torchrun ... -m ptc run PLAN`:
    the command line read the plan); return the exit code."""
    return _train(plan)


def _train(plan: Plan) -> int:
    """Train `plan` as this rank, compiled by `compile_plan`, its model and initial weights
    from `MODELS`."""
    from ptc.lower.driver import compile_plan  # noqa: PLC0415
    from ptc.runtime.train import train_worker  # noqa: PLC0415

    train_worker(plan, compiler=compile_plan, models=MODELS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
