"""`estimate(plan)`: predicted step time, throughput and peak memory of a resolved plan.

Joins the three models: the model's profile (graph-derived per-layer
quantities), the memory model (per stage) and the cost model (per step).
Two FLOP conventions are reported: *model* FLOPs count forward and backward
once (3x forward), *hardware* FLOPs add the recomputed forwards. MFU is
model TFLOP/s per GPU over the dense peak of the plan's dtype.

A plan with checkpoint = "auto" gets, per stage, the mix of none / selective
/ full layers that fits the memory budget (HBM less the plan's
`memory_margin`) with the fewest recomputed FLOPs (`auto_checkpoint`). A
stage that does not fit even with every layer fully recomputed is left fully
recomputed and the estimate says `fits=False`: estimating never raises for
memory. Compiling such a plan does (`ptc.compiler.search.fit.auto_policies`).
"""

from __future__ import annotations

from dataclasses import replace

from ptc.compiler.cost.step import StepCost, policy_flops, step_cost
from ptc.compiler.graph.recompute_regions import LAYER_POLICIES
from ptc.compiler.memory.model import (Precision, check_policies, peak, precision,
                                       stage_host_memory, stage_memory, stage_memory_terms)
from ptc.compiler.profile.cache import plan_profile, with_model_shape
from ptc.compiler.profile.types import ModelProfile
from ptc.compiler.records.estimate import Estimate
from ptc.compiler.records.layout import Layout, layout_of
from ptc.errors import DiagnosticSink, PlanError, UnpricedError
from ptc.plan import DTYPE_BYTES, Plan, is_auto_checkpoint


def plan_precision(plan: Plan, profile: ModelProfile) -> Precision:
    """Model-state bytes per parameter for the plan's dtype and optimizer."""
    opt = plan.train.optimizer
    return precision(profile.dtype_bytes, opt.name, opt.momentum,
                     DTYPE_BYTES[plan.train.grad_dtype], plan.grad_wire_bytes,
                     plan.hardware.runtime_reserve)


def estimate(plan: Plan) -> Estimate:
    """Predict step time, throughput and memory of a resolved plan (no "auto" axis).

    A pipeline whose plan leaves the cut open is priced at the cut ptc compiles, the one
    `balanced_cut` chooses.
    """
    return balanced_cut(plan)[1]


def check_capacity_priced(plan: Plan, profile: ModelProfile) -> None:
    """UnpricedError for a capacity below 1 on a model with routed experts: it drops rows
    even at an even routing, and the models count every routed row (plan search asks too)."""
    factor = plan.moe.capacity_factor
    if profile.routed_rows and factor is not None and factor < 1:
        raise UnpricedError(f"moe.capacity_factor = {factor:g} is not priced: it drops rows "
                            "even at an even routing, and the memory and cost models count "
                            "every routed row")


def balanced_cut(plan: Plan) -> tuple[Plan, Estimate]:
    """The plan with its pipeline cut pinned where ptc compiles it, and its estimate.

    The cut is a decision of the cost model, made here once for the estimate and
    the compile alike (`ptc.lower.resolve`), so what is predicted is what runs.
    A plan that pins its cut (first/last_stage_layers, stage_boundaries) or has
    no pipeline comes back as it is. Else the candidates are Megatron-LM's
    uneven splits: the first and last pipeline rank hold their own counts of
    layers (they also hold the embedding, and the head and the loss), the ranks
    between share the rest evenly. From the even split, a local search moves
    one layer at a time onto or off the end ranks while that makes the step
    faster (among cuts that fit the memory budget; while none fits, while it
    lowers the peak), so the even split stays where nothing is gained. Every
    candidate is priced by `estimate_layout`, the step time `estimate` reports.
    """
    if not plan.is_resolved:
        raise ValueError("estimate needs tp, pp and dp resolved; use search() for 'auto' axes")
    priced = with_model_shape(plan)
    profile = plan_profile(priced)
    if plan.parallel.sequence_parallel and plan.parallel.tp > 1 and profile.routed_rows:
        raise UnpricedError("sequence parallelism with mixture-of-experts blocks is not priced "
                            "yet: each block runs on the whole sequence, which the memory and "
                            "cost models would count split")
    check_capacity_priced(plan, profile)
    prec = plan_precision(priced, profile)
    par, layers = plan.parallel, priced.model.layers
    if par.pp == 1 or par.pins_layers or not layers:
        return plan, _estimate_cut(priced, profile, prec)
    p = par.pp
    scored: dict[tuple[int, int], tuple[tuple, Plan, Estimate]] = {}

    def score(first: int, last: int) -> tuple | None:
        if (first, last) not in scored:
            pinned = _with_ends(plan, first, last, layers)
            if pinned is None:
                return None
            est = _estimate_cut(_with_ends(priced, first, last, layers), profile, prec)
            key = ((0, est.step_time_s, est.peak_memory_bytes) if est.fits
                   else (1, est.peak_memory_bytes, est.step_time_s))
            scored[first, last] = (key, pinned, est)
        return scored[first, last][0]

    even = layers // p
    here = (even, even if p > 2 else layers - even)
    if layers % p or score(*here) is None:  # no even split to start from
        return plan, _estimate_cut(priced, profile, prec)
    while True:
        steps = [(-1, 0), (1, 0), (0, -1), (0, 1), (-1, 1), (1, -1)] if p > 2 else [(-1, 1),
                                                                                   (1, -1)]
        best = here
        for df, dl in steps:
            key = score(here[0] + df, here[1] + dl)
            if key is not None and _better(key, scored[best][0]):
                best = (here[0] + df, here[1] + dl)
        if best == here:
            break
        here = best
    if here == (even, even if p > 2 else layers - even):
        return plan, scored[here][2]
    return scored[here][1], scored[here][2]


def _better(key: tuple, than: tuple) -> bool:
    """Whether score `key` beats `than` by more than rounding (a tie keeps the current cut)."""
    if key[0] != than[0]:
        return key[0] < than[0]
    for a, b in zip(key[1:], than[1:]):
        if abs(a - b) > 1e-9 * max(abs(a), abs(b)):
            return a < b
    return False


def _with_ends(plan: Plan, first: int, last: int, layers: int) -> Plan | None:
    """`plan` with the first and last pipeline rank holding `first` and `last` layers (the
    ranks between share the rest), or None where that split is not valid."""
    if min(first, last) < 0 or first + last > layers:
        return None
    ends = dict(first_stage_layers=first) if plan.parallel.pp == 2 else dict(
        first_stage_layers=first, last_stage_layers=last)
    try:
        par = replace(plan.parallel, **ends)
        sink = DiagnosticSink()
        if par.stage_layers(layers, sink) is None or sink.errors:
            return None
        return replace(plan, parallel=par)
    except PlanError:
        return None


def _estimate_cut(plan: Plan, profile: ModelProfile, prec: Precision) -> Estimate:
    """The estimate of `plan` at the cut it pins (or the even one)."""
    ckpt = plan.parallel.checkpoint
    if is_auto_checkpoint(ckpt):
        layout = auto_checkpoint(profile, layout_of(plan, "none"), prec,
                                 plan.train.seq_len, plan.hardware.memory_budget,
                                 auto_choices(ckpt))
    else:
        layout = layout_of(plan)
    return estimate_layout(profile, layout, plan, prec)


def estimate_layout(profile: ModelProfile, layout: Layout, plan: Plan, prec: Precision
                    ) -> Estimate:
    """Estimate `layout` of `plan`'s model, hardware and batch (search calls this directly)."""
    hw, train = plan.hardware, plan.train
    check_policies(profile, {pol for pol, _ in layout.policy_counts()})
    mem = stage_memory(profile, layout, prec, train.seq_len)
    cost: StepCost = step_cost(profile, layout, hw, prec, seq_len=train.seq_len, dtype=train.dtype,
                               imbalance=plan.routing_imbalance)
    gpus = layout.tp * layout.cp * layout.pp * layout.dp
    step = cost.step_time
    tflops = cost.model_flops / step / gpus / 1e12
    peaks = tuple(peak(terms) for terms in mem)
    return Estimate(
        step_time_s=step,
        tokens_per_s=layout.micro_batch * layout.microbatches * layout.dp * train.seq_len / step,
        tflops_per_gpu=tflops, hw_tflops_per_gpu=cost.hw_flops / step / gpus / 1e12,
        mfu=tflops * 1e12 / hw.peak_flops[train.compute_dtype], peak_memory_bytes=max(peaks),
        stage_memory_bytes=peaks, memory_terms=tuple(mem), breakdown=cost.breakdown,
        hbm_bytes=hw.hbm_bytes, budget_bytes=hw.memory_budget, layout=layout,
        algorithms=cost.algorithms, hidden=cost.hidden,
        host_memory_bytes=max(stage_host_memory(profile, layout, prec)))


AUTO_POLICIES = ("none", "selective", "full")
"""What checkpoint = "auto" chooses from; `auto_checkpoint(..., policies=LAYER_POLICIES)`
(checkpoint = "auto(all)") chooses from op-level and module recompute too."""


def auto_choices(checkpoint: str) -> tuple[str, ...]:
    """The policies checkpoint = `checkpoint` ("auto" or "auto(all)") chooses from."""
    return LAYER_POLICIES if checkpoint == "auto(all)" else AUTO_POLICIES


def auto_checkpoint(profile: ModelProfile, layout: Layout, prec: Precision, seq_len: int,
                    budget: float, policies: tuple[str, ...] = AUTO_POLICIES) -> Layout:
    """`layout` with per-layer policies fitting `budget` per stage with the least recompute.

    Each stage's memory depends on its own layers' policies only, so the
    stages are solved one by one (`stage_mix`), each exactly; their sum is
    then the least total recompute. A stage that cannot fit is fully
    recomputed (its least memory) and the caller sees the overshoot.
    Deterministic: loops over ranges only, ties broken by a fixed rule.
    """
    policy = ["none"] * layout.layers
    for stage in range(layout.pp):
        layers = layout.stage_layers(stage)
        mix = stage_mix(profile, layout, stage, prec, seq_len, budget, policies)
        for pol, layer in zip(mix or ("full",) * len(layers), layers):
            policy[layer] = pol
    return replace(layout, checkpoint=tuple(policy))


def stage_mix(profile: ModelProfile, layout: Layout, stage: int, prec: Precision, seq_len: int,
              budget: float, policies: tuple[str, ...] = AUTO_POLICIES
              ) -> tuple[str, ...] | None:
    """Policies of `stage`'s layers (in order) fitting `budget` with least recompute, or None.

    The memory model prices a stage by how many of its layers take each
    policy (`memory._stage_activations`: its layers are alike) and whether
    its first layer's checkpoint keeps its input (`memory._chunk_ends`), so
    counts are enumerated: for every pair X, Y of `policies` besides "none"
    that the model can take ("full" first, then in their order), all (X, Y)
    count pairs, the other layers "none" — exhaustive over the mixes of at
    most two recomputing policies, not a greedy search. With auto's three
    policies these are the (full, selective) mixes. For each count of X
    layers the fewest Y layers that fit is the cheapest (each adds
    recompute). Recompute per micro-batch: the forward FLOPs of the ops the
    policy reruns (`cost.policy_flops`). Ties go to fewer full layers, then to
    the earlier X, then the earlier Y. X layers come first in the stage, then
    Y ones (each order is priced when only one of them keeps its input): the
    earliest layers' activations live longest, and a full first layer's
    checkpoint holds the stage's input, which is kept anyway.
    """
    n = len(layout.stage_layers(stage))
    chosen = ["full", *(p for p in policies if p not in ("none", "full")
                        and p not in profile.unavailable)]
    cost = {p: policy_flops(profile, p, 1, seq_len) for p in chosen}
    best: tuple[tuple, tuple[str, ...]] | None = None

    def fits(mix: tuple[str, ...]) -> bool:
        return _stage_peak(profile, layout, stage, mix, prec, seq_len) <= budget

    if fits(("none",) * n):
        return ("none",) * n
    for i, x in enumerate(chosen):
        for j in range(i, len(chosen)):  # j == i: X alone
            y = chosen[j]
            for n_x in range(1, n + 1):
                if best is not None and n_x * cost[x] > best[0][0]:
                    break
                for n_y in range(0 if j == i else 1, (n - n_x if j > i else 0) + 1):
                    rest = ("none",) * (n - n_x - n_y)
                    orders = [(x,) * n_x + (y,) * n_y + rest]
                    if (x in profile.holds_input) != (y in profile.holds_input) and n_y:
                        orders.append((y,) * n_y + (x,) * n_x + rest)
                    mix = next((m for m in orders if fits(m)), None)
                    if mix is None:
                        continue
                    key = (n_x * cost[x] + n_y * cost[y], mix.count("full"), i, j)
                    if best is None or key < best[0]:
                        best = (key, mix)
                    break  # more Y layers beside these X ones only recompute more
    return None if best is None else best[1]


def _stage_peak(profile: ModelProfile, layout: Layout, stage: int, mix: tuple[str, ...],
                prec: Precision, seq_len: int) -> float:
    """Peak bytes of `stage` when its layers take the policies `mix` (other stages: none)."""
    policy = ["none"] * layout.layers
    for pol, layer in zip(mix, layout.stage_layers(stage)):
        policy[layer] = pol
    candidate = replace(layout, checkpoint=tuple(policy))
    return float(peak(stage_memory_terms(profile, candidate, stage, prec, bb=layout.micro_batch,
                                         ss=layout.rank_seq(seq_len), tt=layout.tp,
                                         dd=layout.grad_ranks)))
