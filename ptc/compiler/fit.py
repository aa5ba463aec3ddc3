"""What fits in memory: the largest micro-batch, the smallest tp·pp.

Both answer by solving the memory model for one unknown while the rest of
the plan stays as written; the memory expression is monotone in each (more
samples per micro-batch never need less memory; more model parallelism never
needs more per rank), so the first size that fits is the answer.
"""

from __future__ import annotations

import dataclasses

from ptc.compiler.estimate import plan_precision
from ptc.compiler.layout import layout_of
from ptc.compiler.memory import peak, stage_memory
from ptc.compiler.profile import model_profile
from ptc.compiler.search import axis_choices
from ptc.plan import Plan


def _fits(plan: Plan, **layout_changes) -> bool:
    profile = model_profile(plan.model, plan.train.dtype)
    ckpt = "full" if plan.parallel.checkpoint == "auto" else None
    layout = dataclasses.replace(layout_of(plan, ckpt), **layout_changes)
    mem = stage_memory(profile, layout, plan_precision(plan, profile), plan.train.seq_len)
    return max(peak(t) for t in mem) <= plan.hardware.hbm_bytes


def largest_micro_batch(plan: Plan) -> int | None:
    """The largest micro-batch dividing the per-rank batch that fits; None if none does."""
    per_rank = plan.train.global_batch // plan.parallel.dp
    best = None
    for mb in (k for k in range(1, per_rank + 1) if per_rank % k == 0):
        m = per_rank // mb
        if plan.parallel.pp > 1 and m < plan.parallel.pp:
            break
        if not _fits(plan, micro_batch=mb, microbatches=m):
            break
        best = mb
    return best


def smallest_model_parallel(plan: Plan) -> tuple[int, int] | None:
    """The (tp, pp) of least tp·pp that fits (ties: less pp), dp taking the remaining GPUs."""
    auto = dataclasses.replace(plan.parallel, tp="auto", pp="auto", dp="auto")
    choices = sorted(axis_choices(dataclasses.replace(plan, parallel=auto)),
                     key=lambda c: (c[0] * c[1], c[1]))
    batch, mb = plan.train.global_batch, plan.train.micro_batch
    for tp, pp, dp in choices:
        if batch % (dp * mb) or (pp > 1 and batch // (dp * mb) < pp):
            continue
        v = plan.parallel.virtual_stages if plan.model.layers % (pp * plan.parallel.virtual_stages) == 0 else 1
        if _fits(plan, tp=tp, pp=pp, dp=dp, vstages=v, microbatches=batch // (dp * mb),
                 schedule=plan.parallel.schedule if v > 1 else "1f1b",
                 sp=plan.parallel.sequence_parallel and tp > 1):
            return tp, pp
    return None
