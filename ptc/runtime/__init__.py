"""The runtime: launch processes, build process groups, run a Program's graphs, train.

Public entry points: `run(plan_or_program, models=, preflight=, compiler=)`
trains from Python (what `ptc.run` calls, handing in what the runtime must
not import: the model factory, the preflight checks and the compiler),
`launch(plan, write_plan, nproc, extra_launcher_args)` is what `ptc run PLAN`
calls with the plan it read, `Trainer` is one rank's training state (for
tests and notebooks), `bench_comm` measures collective bandwidth per mesh
axis (`ptc bench-comm`; `ptc.views.comm_report` shows it).
Submodules load lazily so that `import ptc.runtime` stays cheap.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "run": ("ptc.runtime.train", "run"),
    "train_worker": ("ptc.runtime.train", "train_worker"),
    "RunResult": ("ptc.runtime.train", "RunResult"),
    "launch": ("ptc.runtime.launcher", "launch"),
    "run_local": ("ptc.runtime.launcher", "run_local"),
    "Trainer": ("ptc.runtime.executor", "Trainer"),
    "RankError": ("ptc.runtime.executor", "RankError"),
    "StepStats": ("ptc.runtime.executor", "StepStats"),
    "bench_comm": ("ptc.runtime.bench_comm", "bench_comm"),
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ptc.runtime' has no attribute {name!r}")
