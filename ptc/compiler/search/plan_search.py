"""Plan search: every valid layout of a plan, filtered by memory, ranked by step time.

The axes the plan leaves "auto" (any of tp, pp, dp) are enumerated over the
divisors that the model and GPU count allow, and `ep = auto` over the
divisors of dp·cp that divide the model's routed experts (the plan's ep
where it names one: only the meshes whose dp·cp it divides); the rest of the layout is
always enumerated: virtual stages (1F1B, or interleaved with v dividing the
layers per stage, each also as zero bubble, and as ZB-V and DualPipeV with
two chunks per rank), micro-batch (divisors of the per-rank batch), ZeRO stage (0-3, >0 only with dp > 1; 1-3 when the plan offloads its optimizer),
sequence parallelism (with tp > 1), and a uniform checkpoint policy (none,
selective, full). GPipe is not enumerated: it has 1F1B's bubble and more
activation memory, so never wins.

Where a layout does not fit without recompute but fits fully recomputed, it
is also tried with per-layer policies: the least-recompute mix of none,
selective and full that fits each stage (`checkpoint = "auto"`'s solver,
`estimate.auto_checkpoint`), as Megatron-LM's `--recompute-num-layers`
recomputes only some layers. Such a layout is written back as `checkpoint =
"auto"`, which chooses the same mix.

Nothing is captured per candidate: the model's profile is captured once and
each layout is priced by the closed-form memory and cost models. A layout
fits when its peak is within the budget (HBM less the plan's
`memory_margin`); one that does not is kept with its overshoot so the report
can say why it lost — search never raises for memory.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass

from ptc.compiler.cost.step import compute_floor, floor_layer_times, step_cost
from ptc.compiler.records.estimate import Estimate
from ptc.compiler.search.estimate import (auto_checkpoint, check_capacity_priced, estimate,
                                         plan_precision)
from ptc.compiler.records.layout import Layout
from ptc.compiler.schedule.build import required_microbatches
from ptc.compiler.memory.model import peak, stage_memory_terms
from ptc.compiler.profile.types import ModelProfile
from ptc.compiler.profile.cache import plan_profile, with_model_shape
from ptc.plan import AUTO, Plan

CHECKPOINTS = ("none", "selective", "full")
"""Uniform checkpoint policies the search tries (and mixes of them, per layer)."""
MAX_MICRO_BATCH = 64
"""Largest micro-batch tried; larger ones only add activation memory."""
MAX_CP = 16
"""Largest context-parallel degree `cp = auto` tries."""


@dataclass(frozen=True, slots=True)
class Rejected:
    """A layout that does not fit in memory."""

    layout: Layout
    """The layout."""
    peak_bytes: float
    """Its peak bytes on the most loaded stage."""
    over_bytes: float
    """By how much that exceeds the memory budget (HBM less the margin)."""


@dataclass(frozen=True, slots=True)
class SearchResult:
    """Ranked layouts that fit, and those that do not."""

    ranked: list[tuple[Plan, Estimate]]
    """The fastest fitting layouts, fastest first."""
    rejected: list[Rejected]
    """Layouts that do not fit, least over first."""
    candidates: int
    """Layouts enumerated (each per-layer mix tried counts as one)."""
    fitting: int
    """Layouts that fit in memory."""


@dataclass(frozen=True, slots=True)
class _Candidate:
    """A layout that fits, with the lower bound of its step time it is ranked by."""

    floor: float
    """`cost.compute_floor` of the layout (for a mix: with the least recompute it needs)."""
    layout: Layout
    """The layout; for a mix, its checkpoint is "none" until the mix is chosen."""
    mix: bool
    """Whether per-layer policies are yet to be chosen (`auto_checkpoint`)."""


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def axis_choices(plan: Plan) -> list[tuple[int, int, int, int]]:
    """(tp, cp, pp, dp) the model, sequence and GPU count allow, honouring fixed axes
    (cp = auto tries the degrees up to MAX_CP whose 2·cp chunks divide the sequence)."""
    par, model, gpus, seq = plan.parallel, plan.model, plan.num_gpus, plan.train.seq_len
    out = []
    for tp in ([par.tp] if par.tp != AUTO else _divisors(gpus)):
        if model.heads % tp or model.ffn_size % tp or not model.kv_heads_fit(tp):
            continue
        cps = [par.cp] if par.cp != AUTO else [
            c for c in _divisors(gpus // tp) if c == 1 or (c <= MAX_CP and seq % (2 * c) == 0)]
        for cp in cps:
            for pp in ([par.pp] if par.pp != AUTO else _divisors(gpus // (tp * cp))):
                if model.layers % pp or gpus % (tp * cp * pp):
                    continue
                dp = gpus // (tp * cp * pp)
                if par.dp != AUTO and par.dp != dp:
                    continue
                out.append((tp, cp, pp, dp))
    return out


def enumerate_layouts(plan: Plan, experts: int = 0) -> list[Layout]:
    """Every valid layout of `plan` (see module docstring); `experts`: the model's routed
    experts per layer, which an `ep = auto` layout's ep must divide (0: none, ep 1)."""
    layouts = []
    for tp, cp, pp, dp in axis_choices(plan):
        if plan.train.global_batch % dp:
            continue
        for ep in _expert_parallel(plan.parallel.ep, dp * cp, experts):
            layouts += _layouts_at(plan, tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, moe=experts > 0)
    return layouts


def _layouts_at(plan: Plan, *, tp: int, cp: int, pp: int, dp: int, ep: int,
                moe: bool) -> list[Layout]:
    """The layouts of one mesh: every micro-batch, interleaving, ZeRO stage, schedule,
    sequence parallelism (not for a model with routed experts, `moe`: not priced) and
    recompute policy worth pricing."""
    model, par = plan.model, plan.parallel
    per_rank = plan.train.global_batch // dp
    layouts = []
    for mb in [k for k in _divisors(per_rank) if k <= MAX_MICRO_BATCH]:
        m = per_rank // mb
        if pp > 1 and m < pp:
            continue
        vs = [1] + ([v for v in _divisors(model.layers // pp)[1:] if m % pp == 0]
                    if pp > 1 else [])
        for v in vs:
            for zero in _zero_stages(dp * cp, offload=par.offload != "none"):
                for schedule in _schedules(pp, v, m, zero, plan.runtime.compile):
                    for sp in _sequence_parallel(tp, par.tp_comm, moe=moe):
                        for ckpt in CHECKPOINTS:
                            layouts.append(Layout(
                                tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, vstages=v, micro_batch=mb,
                                microbatches=m, zero=zero, sp=sp, schedule=schedule,
                                layers=model.layers, checkpoint=ckpt, overlap=par.overlap,
                                order=par.order, offload=par.offload != "none",
                                fused=plan.runtime.compile,
                                tp_comm=par.tp_comm if sp else "sync"))
    return layouts


def _expert_parallel(ep: int | str, ranks: int, experts: int) -> list[int]:
    """The ep degrees to try on `ranks` dp·cp ranks: the plan's where it divides them;
    for "auto" every divisor of both them and the layer's `experts` (1 without experts)."""
    if ep != AUTO:
        return [ep] if ranks % ep == 0 else []
    return [e for e in _divisors(ranks) if experts and experts % e == 0] or [1]


def _sequence_parallel(tp: int, tp_comm: str, *, moe: bool) -> tuple[bool, ...]:
    """Sequence parallelism off and on where tp splits layers; on alone when the plan asks
    for its collectives as collective matmuls (`tp_comm = async`); off for a model with
    routed experts (`moe`), whose blocks run on the whole sequence: not priced."""
    if tp == 1 or moe:
        return (False,)
    return (True,) if tp_comm == "async" else (False, True)


def _schedules(pp: int, v: int, m: int, zero: int, compiled: bool) -> tuple[str, ...]:
    """Schedules worth trying: 1F1B (interleaved for v >= 2), and where a split backward runs
    (pp >= 2, uncompiled graphs: `ptc.checks`) zero bubble on the same order and, with two
    chunks per rank, ZB-V and (m >= 2p) DualPipeV."""
    base = "interleaved" if v > 1 else "1f1b"
    if pp == 1 or compiled:
        return (base,)
    if v != 2:
        return (base, "zero_bubble")
    runs = m >= required_microbatches("dualpipev", pp)
    return (base, "zero_bubble", "zbv") + (("dualpipev",) if runs else ())


def _zero_stages(dp: int, *, offload: bool) -> tuple[int, ...]:
    """ZeRO stages worth trying at `dp`: 0-3 (0 alone at dp = 1); 1-3 when the plan offloads
    its optimizer, which needs a ZeRO stage (1 alone at dp = 1)."""
    if dp == 1:
        return (1,) if offload else (0,)
    return (1, 2, 3) if offload else (0, 1, 2, 3)


NO_CUT = dict(first_stage_layers=None, last_stage_layers=None, stage_boundaries=())
"""The parallel fields that unpin a pipeline cut: a cut is for its own pp and v."""


def to_plan(plan: Plan, layout: Layout) -> Plan:
    """`plan` with its parallel section and micro-batch set to `layout` (per-layer policies
    as checkpoint = "auto", which chooses them again; a pinned cut kept only where the
    pipeline it was pinned for stays)."""
    ckpt = layout.checkpoint if isinstance(layout.checkpoint, str) else "auto"
    par = plan.parallel
    cut = NO_CUT if (layout.pp, layout.vstages) != (par.pp, par.virtual_stages) else {}
    parallel = dataclasses.replace(
        par, tp=layout.tp, pp=layout.pp, dp=layout.dp, cp=layout.cp, ep=layout.ep,
        zero=layout.zero,
        sequence_parallel=layout.sp, tp_comm=layout.tp_comm, schedule=layout.schedule,
        virtual_stages=layout.vstages, checkpoint=ckpt, microbatches=None, **cut)
    train = dataclasses.replace(plan.train, micro_batch=layout.micro_batch)
    return dataclasses.replace(plan, parallel=parallel, train=train)


def _mix_floor(profile: ModelProfile, base: Layout, peaks: dict[str, dict[int, float]],
               plan: Plan) -> float:
    """A lower bound of the step time of `base` under the least-recompute per-layer mix that
    fits, given each uniform policy's peak per checked stage (`peaks[policy][stage]`).

    A stage over the budget by E bytes must recompute layers that free at least E;
    policy p frees (peak under none - peak under p) / layers a layer at
    `recompute[p]` seconds, and the memory model prices a stage's activations
    linearly in how many of its layers take each policy, so no mix frees E for less
    than E times the cheapest seconds per byte freed.
    """
    hw, budget = plan.hardware, plan.hardware.memory_budget
    times = floor_layer_times(profile, base, hw, seq_len=plan.train.seq_len,
                              dtype=plan.train.dtype)
    extra = 0.0
    for stage, need in peaks["none"].items():
        if need <= budget:
            continue
        layers = len(base.stage_layers(stage))
        extra += (need - budget) * min(times.recompute[p] * layers / (need - peaks[p][stage])
                                       for p in CHECKPOINTS[1:] if peaks[p][stage] < need)
    return compute_floor(profile, base, hw, seq_len=plan.train.seq_len, dtype=plan.train.dtype,
                         extra_recompute=extra)


def search_all(plan: Plan, top: int = 5) -> SearchResult:
    """Enumerate, filter by memory, rank by step time; the `top` fastest become Plans."""
    plan = with_model_shape(plan)
    profile = plan_profile(plan)
    check_capacity_priced(plan, profile)
    prec = plan_precision(plan, profile)
    budget, seq, dtype = plan.hardware.memory_budget, plan.train.seq_len, plan.train.dtype
    layouts = enumerate_layouts(plan, profile.routed_experts)
    fitting: list[_Candidate] = []
    rejected, memo = [], {}
    # Per layout without its policy: each uniform policy's peak on the checked stages.
    peaks: dict[Layout, dict[str, dict[int, float]]] = {}
    for lay in layouts:
        # Stage 0 holds the most micro-batches in flight and the embedding, the last
        # stage the head: no middle stage can peak above both.
        stage_peaks = {i: float(peak(stage_memory_terms(
            profile, lay, i, prec, bb=lay.micro_batch, ss=lay.rank_seq(seq), tt=lay.tp,
            dd=lay.grad_ranks))) for i in {0, lay.last_rank}}
        peaks.setdefault(dataclasses.replace(lay, checkpoint="none"), {})[lay.checkpoint] = \
            stage_peaks
        worst = max(stage_peaks.values())
        if worst > budget:
            rejected.append(Rejected(lay, worst, worst - budget))
        else:
            floor = compute_floor(profile, lay, plan.hardware, seq_len=seq, dtype=dtype)
            fitting.append(_Candidate(floor, lay, mix=False))
    mixes = [_Candidate(_mix_floor(profile, base, by_policy, plan), base, mix=True)
             for base, by_policy in peaks.items()
             if max(by_policy["none"].values()) > budget >= max(by_policy["full"].values())]
    fitting += mixes
    rejected.sort(key=lambda r: r.over_bytes)
    # Branch and bound: price layouts in order of their floor, until the floor alone is
    # slower than the `top`-th fastest priced so far.
    fitting.sort(key=lambda c: c.floor)
    best: list[tuple[float, int, Layout]] = []
    imbalance = plan.routing_imbalance
    for n, candidate in enumerate(fitting):
        if len(best) == top and candidate.floor >= -best[0][0]:
            break
        lay = candidate.layout
        if candidate.mix:
            lay = auto_checkpoint(profile, lay, prec, seq, budget)
            if len(set(lay.checkpoint)) == 1:  # a uniform policy: enumerated already
                continue
        time = step_cost(profile, lay, plan.hardware, prec, seq_len=seq, dtype=dtype,
                         memo=memo, imbalance=imbalance).step_time
        heapq.heappush(best, (-time, -n, lay))
        if len(best) > top:
            heapq.heappop(best)
    # Each plan is priced as it compiles: at the pipeline cut the cost model balances.
    plans = [to_plan(plan, lay) for _, _, lay in sorted(best, key=lambda x: (-x[0], -x[1]))]
    ranked = sorted(((p, estimate(p)) for p in plans), key=lambda pe: pe[1].step_time_s)
    return SearchResult(ranked=ranked, rejected=rejected, candidates=len(layouts) + len(mixes),
                        fitting=len(fitting))


def search(plan: Plan, top: int = 5) -> list[tuple[Plan, Estimate]]:
    """The `top` fastest layouts of `plan` that fit in memory, with their estimates."""
    return search_all(plan, top).ranked
