"""What fits in memory: the largest micro-batch, the smallest tp·pp, and checkpoint = "auto".

The first two answer by solving the memory model for one unknown while the
rest of the plan stays as written; the memory expression is monotone in each
(more samples per micro-batch never need less memory; more model parallelism
never needs more per rank), so the first size that fits is the answer. A plan
with checkpoint = "auto" is asked with every layer fully recomputed, its
least memory. "Fits" means within the budget: HBM less the plan's
`memory_margin`.

`auto_policies` resolves checkpoint = "auto" for compiling and is where a
plan that cannot fit stops with a CompileError naming the stage, the
overshoot and what would fit. `estimate` and plan search never raise for
memory: they report `fits=False` and rank such layouts out.
"""

from __future__ import annotations

import dataclasses

from ptc.compiler.search.estimate import auto_checkpoint, auto_choices, plan_precision
from ptc.compiler.records.layout import layout_of
from ptc.compiler.memory.model import peak, stage_memory
from ptc.compiler.profile.cache import plan_profile
from ptc.compiler.search.plan_search import NO_CUT, axis_choices
from ptc.errors import CompileError
from ptc.plan import Plan, is_auto_checkpoint
from ptc.presets import GiB
from ptc.units import format_bytes


def _fits(plan: Plan, **layout_changes) -> bool:
    profile = plan_profile(plan)
    ckpt = "full" if is_auto_checkpoint(plan.parallel.checkpoint) else None
    base = layout_of(plan, ckpt)
    if (layout_changes.get("pp", base.pp), layout_changes.get("vstages", base.vstages)) \
            != (base.pp, base.vstages):  # the plan's uneven split is for its own stages
        layout_changes["chunk_layers"] = ()
    layout = dataclasses.replace(base, **layout_changes)
    mem = stage_memory(profile, layout, plan_precision(plan, profile), plan.train.seq_len)
    return max(peak(t) for t in mem) <= plan.hardware.memory_budget


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
    auto = dataclasses.replace(plan.parallel, tp="auto", pp="auto", dp="auto", **NO_CUT)
    choices = sorted(((tp, pp, dp) for tp, _, pp, dp in
                      axis_choices(dataclasses.replace(plan, parallel=auto))),
                     key=lambda c: (c[0] * c[1], c[1]))
    batch, mb = plan.train.global_batch, plan.train.micro_batch
    for tp, pp, dp in choices:
        if batch % (dp * mb) or (pp > 1 and batch // (dp * mb) < pp):
            continue
        v = plan.parallel.virtual_stages if plan.model.layers % (pp * plan.parallel.virtual_stages) == 0 else 1
        # One chunk per rank: priced as 1F1B, unless the plan splits its backward.
        schedule = plan.parallel.schedule if v > 1 or plan.parallel.schedule == "zero_bubble" \
            else "1f1b"
        if _fits(plan, tp=tp, pp=pp, dp=dp, vstages=v, microbatches=batch // (dp * mb),
                 schedule=schedule,
                 sp=plan.parallel.sequence_parallel and tp > 1):
            return tp, pp
    return None


def auto_policies(plan: Plan) -> tuple[str, ...]:
    """Per-layer policies of checkpoint = "auto" (`estimate.auto_checkpoint`), for compiling.

    Raises CompileError when a stage does not fit the budget even with every
    layer fully recomputed: compiling such a plan would only fail later, out
    of memory, so it stops here with the numbers and what would fit.
    """
    profile = plan_profile(plan)
    prec = plan_precision(plan, profile)
    layout = auto_checkpoint(profile, layout_of(plan, "none"), prec, plan.train.seq_len,
                             plan.hardware.memory_budget, auto_choices(plan.parallel.checkpoint))
    peaks = [peak(t) for t in stage_memory(profile, layout, prec, plan.train.seq_len)]
    if max(peaks) > plan.hardware.memory_budget:
        raise CompileError(nothing_fits_message(plan, peaks))
    return layout.checkpoint


def nothing_fits_message(plan: Plan, peaks: list[float]) -> str:
    """Why checkpoint = "auto" cannot fit: each stage over, by how much, and what would fit.

    `peaks`: bytes per stage with the auto choice (stages over the budget
    are the fully recomputed ones).
    """
    hw = plan.hardware
    budget = hw.memory_budget
    over = [f"stage {i} needs {need / GiB:.3f} GiB with every layer fully recomputed, "
            f"{format_bytes(need - budget)} over"
            for i, need in enumerate(peaks) if need > budget]
    mb = largest_micro_batch(plan)
    mp = smallest_model_parallel(plan)
    return (f"checkpoint = auto: nothing fits: {'; '.join(over)} the budget of "
            f"{budget / GiB:.3f} GiB per GPU (hbm {hw.hbm_bytes / GiB:.3f} GiB less "
            f"memory_margin {hw.memory_margin / GiB:.3f} GiB). What would fit: largest "
            f"micro-batch {mb if mb is not None else 'none'} (now {plan.train.micro_batch}); "
            f"smallest tp x pp {f'tp{mp[0]} x pp{mp[1]}' if mp else 'none'} on "
            f"{plan.num_gpus} GPUs (now tp{plan.parallel.tp} x pp{plan.parallel.pp})")
