"""`python -m ptc.worker PLAN [--section.key=value ...]`: what each process `ptc run` starts runs.

It sits above the runtime: it compiles the plan (`ptc.lower.driver`) and
hands the Program to the runtime, which never imports the compiler passes.

`record` writes the exception of a failing rank to the file torchrun reads,
so the launcher reports that rank's message (rank, graph node, source line)
as the root cause.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main(argv: Sequence[str] | None = None) -> int:
    """Load the plan file and train it as this rank; return the exit code."""
    from ptc.dsl import load_plan  # noqa: PLC0415
    from ptc.lower.driver import compile_plan  # noqa: PLC0415
    from ptc.runtime.train import train_worker  # noqa: PLC0415

    from ptc.dsl.overrides import split_overrides  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="ptc.worker")
    parser.add_argument("plan", help="plan file (.ptc)")
    rest, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(rest)
    train_worker(load_plan(args.plan, overrides=overrides), compiler=compile_plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
