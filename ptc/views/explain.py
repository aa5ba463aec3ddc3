"""Rich renderings of estimates and searches, for `ptc explain` and `ptc plan`.

Only presentation lives here: every number comes from `estimate`, `search`,
`memory` and `fit`. `render_explain(plan)` shows one plan's step-time
breakdown, per-stage memory (numbers and the symbolic expression of the most
loaded stage) and what would fit; `render_search(plan, top)` the fastest
layouts that fit and the nearest ones that do not.
"""

from __future__ import annotations

from dataclasses import replace

import sympy
from rich.console import Group

from ptc.compiler.cost.compute import Split, rates, tile_efficiency
from ptc.compiler.cost.goodput import (checkpoint_interval, goodput, job_mtbf, save_pause,
                                       snapshot_bytes, snapshot_goodput, snapshot_pause)
from ptc.compiler.cost.step import ep_bytes_per_step, ep_rows_bytes, policy_flops, rerun_gathers
from ptc.compiler.records.estimate import Estimate
from ptc.compiler.search.estimate import estimate, plan_precision
from ptc.compiler.search.fit import largest_micro_batch, smallest_model_parallel
from ptc.compiler.records.layout import Layout
from ptc.compiler.memory.model import TERMS, peak, stage_memory, stage_memory_expr
from ptc.compiler.records.overlap import GRAD_BYTES, IN_FLIGHT
from ptc.compiler.cost.buckets import PredictedBucket, dp_group, dp_link, predicted_buckets
from ptc.compiler.profile.cache import plan_profile, with_model_shape
from ptc.compiler.search.plan_search import search_all
from ptc.views.tables import GLUE, FitTable, Prose
from ptc.hwprofile import ProfileError, load_profile
from ptc.runtime.snapshot_room import default_tmpfs, snapshots_fit
from ptc.plan import AUTO, DTYPE_BYTES, HardwareSpec, LinkSpec, Plan
from ptc.presets import PRESETS
from ptc.units import format_bytes, format_duration, format_seconds

PARTS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "dp_comm", "bubble",
         "contention", "optimizer", "step_sync")
"""Step-time parts in display order."""
COMM_PARTS = ("tp_comm", "cp_comm", "ep_comm", "pp_comm", "dp_comm", "step_sync")
"""The parts that are communication."""


def describe_layout(layout: Layout) -> str:
    """One line naming a layout: `tp8 pp4 dp2 v2 b1 zero1 sp ckpt=selective`, its schedule
    named where it is not 1F1B (`zero_bubble`, `zbv`, `dualpipev`, `gpipe`)."""
    ckpt = layout.checkpoint if isinstance(layout.checkpoint, str) else "mixed(" + ",".join(
        f"{p}:{n}" for p, n in layout.policy_counts()) + ")"
    parts = [f"tp{layout.tp}"] + ([f"cp{layout.cp}"] if layout.cp != 1 else []) + \
        [f"pp{layout.pp}", f"dp{layout.dp}"] + ([f"ep{layout.ep}"] if layout.ep != 1 else [])
    if layout.vstages > 1:
        parts.append(f"v{layout.vstages}")
    if layout.schedule not in ("1f1b", "interleaved"):  # 1F1B (interleaved for v > 1): unsaid
        parts.append(layout.schedule)
    parts += [f"b{layout.micro_batch}", f"m{layout.microbatches}", f"zero{layout.zero}"]
    if layout.sp:
        parts.append("sp")
    if layout.offload:
        parts.append("offload")
    parts.append(f"ckpt={ckpt}")
    return " ".join(parts)


def _summary(est: Estimate, gpus_per_node: int) -> FitTable:
    table = FitTable(title="Step", plain=True)
    table.add_column()
    table.add_column(justify="right", number=False)
    rows = [("layout", describe_layout(est.layout)),
            ("step time", format_seconds(est.step_time_s)),
            ("tokens/s", f"{est.tokens_per_s:,.0f}"),
            ("TFLOP/s per GPU (model)", f"{est.tflops_per_gpu:.1f}"),
            ("TFLOP/s per GPU (hardware, incl. recompute)", f"{est.hw_tflops_per_gpu:.1f}"),
            ("MFU", f"{est.mfu:.1%}"),
            ("peak memory", f"{format_bytes(est.peak_memory_bytes)} of a "
                            f"{format_bytes(est.budget_bytes)} budget"
                            + ("" if est.fits else "  DOES NOT FIT")),
            ("collectives", ", ".join(f"{k}: {v}" for k, v in est.algorithms.items()) or "none")]
    if est.layout.offload:
        rows.insert(-1, ("host memory (optimizer offload)",
                         f"{format_bytes(est.host_memory_bytes)} per rank, "
                         f"{format_bytes(est.host_memory_bytes * gpus_per_node)} per node of "
                         f"{gpus_per_node}"))
    for name, value in rows:
        table.add_row(name, value)
    return table


def _breakdown(est: Estimate) -> FitTable:
    table = FitTable(title="Where the step time goes")
    table.add_column("part")
    table.add_column("time", justify="right")
    table.add_column("share", justify="right")
    for part in PARTS:
        seconds = est.breakdown[part]
        table.add_row(part, format_seconds(seconds), f"{seconds / est.step_time_s:.1%}")
    for part, seconds in est.hidden.items():  # overlapped: shown, not counted
        if part not in COMM_PARTS:  # communication's: in its own table
            table.add_row(f"{part}, hidden", format_seconds(seconds), "overlapped")
    return table


def _communication(est: Estimate) -> FitTable:
    """Each kind of communication a step issues: what ran beside compute (hidden) and what
    the step waits for (exposed, in the step time), as the runtime orders them."""
    table = FitTable(title="Communication: issued = hidden beside compute + exposed")
    for name in ("kind", "issued", "hidden", "exposed"):
        table.add_column(name, justify="left" if name == "kind" else "right")
    for part in COMM_PARTS:
        exposed, hidden = est.breakdown[part], est.hidden.get(part, 0.0)
        if exposed or hidden:
            table.add_row(part, format_seconds(exposed + hidden), format_seconds(hidden),
                          format_seconds(exposed))
    return table


def _memory(est: Estimate) -> FitTable:
    table = FitTable(title="Memory per pipeline stage (most loaded rank)")
    table.add_column("stage", justify="right")
    for term in TERMS:
        table.add_column(term, justify="right")
    table.add_column("peak", justify="right")
    for i, terms in enumerate(est.memory_terms):
        table.add_row(str(i), *(format_bytes(terms[k]) for k in TERMS),
                      format_bytes(est.stage_memory_bytes[i]))
    return table


def _checkpointing(plan: Plan, est: Estimate) -> FitTable:
    """Per stage: each layer's policy, memory without and with it, against the budget; recompute.

    The budget is stated with its parts (HBM less the plan's memory_margin):
    it is what checkpoint = "auto" fits each stage to.
    """
    layout = est.layout
    profile = plan_profile(plan)
    before = [peak(terms) for terms in stage_memory(
        profile, replace(layout, checkpoint="none"), plan_precision(plan, profile),
        plan.train.seq_len)]
    b, s = layout.micro_batch, plan.train.seq_len
    ckpt = plan.parallel.checkpoint
    how = {"auto": "auto: per stage, the least recompute that fits",
           "auto(all)": "auto(all): per stage, the least recompute of any policy that fits"
           }.get(ckpt, ckpt) \
        if isinstance(ckpt, str) else "per layer"
    table = FitTable(title=f"Activation checkpointing (checkpoint = {how}; budget "
                        f"{format_bytes(est.budget_bytes)} per GPU = HBM "
                        f"{format_bytes(est.hbm_bytes)} less margin "
                        f"{format_bytes(est.margin_bytes)})")
    for name in ("stage", "layers: policy", "memory without", "memory with", "saved",
                 "vs budget", "recompute FLOPs / micro-batch"):
        table.add_column(name, justify="left" if name == "layers: policy" else "right")
    for i in range(layout.pp):
        layers = layout.stage_layers(i)
        policies = [layout.checkpoint if isinstance(layout.checkpoint, str)
                    else layout.checkpoint[n] for n in layers]
        text = _policy_runs(layers, policies)
        after = est.stage_memory_bytes[i]
        flops = f"{sum(float(policy_flops(profile, pol, b, s)) for pol in policies):.3g}"
        gathers = sum(rerun_gathers(profile, pol, layout.sp) for pol in policies)
        if gathers:  # priced in tp_comm
            flops += f", {gathers} all-gathers again"
        table.add_row(str(i), text, format_bytes(before[i]), format_bytes(after),
                      format_bytes(before[i] - after), _vs_budget(est.budget_bytes - after),
                      flops)
    return table


def _policy_runs(layers: list[int], policies: list[str]) -> str:
    """`0-1:full, 2:selective, 3-9:none`: consecutive layers of one policy as one run."""
    return ", ".join(f"{_span(a, b)}:{pol}" for a, b, pol in _runs(layers, policies))


def _ranges(numbers: list[int]) -> str:
    """`0-9, 40-49`: consecutive numbers as ranges."""
    return ", ".join(_span(a, b) for a, b, _ in _runs(numbers, [None] * len(numbers)))


def _runs(numbers: list[int], keys: list) -> list[list]:
    """[first, last, key] of each run of consecutive numbers sharing a key."""
    runs: list[list] = []
    for n, key in zip(numbers, keys):
        if runs and runs[-1][1] == n - 1 and runs[-1][2] == key:
            runs[-1][1] = n
        else:
            runs.append([n, n, key])
    return runs


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def _vs_budget(headroom: float) -> str:
    """`1.2 GiB free`, or `300.0 MiB OVER` for a stage that does not fit."""
    return f"{format_bytes(headroom)} free" if headroom >= 0 else f"{format_bytes(-headroom)} OVER"


def _expression(plan: Plan, est: Estimate) -> Group:
    profile = plan_profile(plan)
    stage = est.stage_memory_bytes.index(est.peak_memory_bytes)
    terms = stage_memory_expr(profile, est.layout, plan_precision(plan, profile), stage)
    head = Prose(f"Memory of stage {stage} in bytes (b micro-batch, s sequence, t tp, d dp, "
                 f"m micro-batches):")
    lines = [f"  {name} = {_breakable(sympy.sstr(expr))}" for name, expr in terms.items()]
    return Group(head, Prose("\n".join(lines), indent=4))


def _breakable(formula: str) -> str:
    """`formula` with every space GLUE but those before a top-level `+` or `-`: wrapped, it
    breaks between terms (the operator opening the next line), never inside a bracket."""
    out, depth = [], 0
    for i, ch in enumerate(formula):
        depth += (ch in "([") - (ch in ")]")
        between = depth == 0 and formula[i + 1:i + 3] in ("+ ", "- ")
        out.append(GLUE if ch == " " and not between else ch)
    return "".join(out)


def _fit_hints(plan: Plan) -> Prose:
    mb = largest_micro_batch(plan)
    mp = smallest_model_parallel(plan)
    return Prose(f"Largest micro-batch that fits: {mb if mb is not None else 'none'}; "
                 f"smallest tp x pp that fits: "
                 f"{f'tp{mp[0]} x pp{mp[1]}' if mp else 'none'}")


def render_explain(plan: Plan, est: Estimate | None = None, *, compiled: bool = False
                   ) -> Group:
    """The full explanation of one resolved plan, as a rich renderable.

    `est`: the estimate to render, a compile's (`Program.decisions`, `compiled`) or the
    plan's alone; None estimates the plan here. Nothing below estimates again: the
    other figures (memory without recompute, what would fit) are the memory model's.
    """
    plan = with_model_shape(plan)
    est = estimate(plan) if est is None else est
    source = Prose("Predicted from the compile's decisions: the pipeline cut, recompute "
                   "policies and buckets ptc lowers." if compiled else
                   "Predicted from the plan alone, not compiled (--plan-only): the cut and "
                   "policies a compile would choose.")
    parts = [source, _summary(est, plan.hardware.gpus_per_node), _breakdown(est),
             _communication(est), _rates(plan, est), _memory(est)]
    if est.layout.ep > 1:
        parts.append(_experts(plan, est))
    if plan.parallel.checkpoint != "none":
        parts.append(_checkpointing(plan, est))
    parts.append(_overlap(plan, est))
    return Group(*parts, _expression(plan, est), _fit_hints(plan), _failures(plan, est))


def _experts(plan: Plan, est: Estimate) -> Prose:
    """What expert parallelism moves: each layer's routed rows, per all-to-all."""
    profile = plan_profile(plan)
    lay, prec = est.layout, plan_precision(plan, profile)
    rows = ep_rows_bytes(profile, prec, lay.micro_batch, lay.rank_seq(plan.train.seq_len))
    step = ep_bytes_per_step(profile, lay, prec, plan.train.seq_len)
    u = plan.routing_imbalance
    where = "the plan's moe.imbalance" if plan.moe.imbalance is not None else \
        "measured by ptc calibrate" if u != 1.0 else "an even routing; ptc calibrate measures it"
    return Prose(f"Experts: each rank holds 1/{lay.ep} of every layer's routed experts; each "
                 f"all-to-all of a layer is handed {format_bytes(rows)} per micro-batch "
                 f"({profile.routed_rows} routed rows per token; dispatch and combine forward, "
                 f"their gradients backward, again where a layer is recomputed: "
                 f"{format_bytes(step)} a step on the busiest stage), charged in memory at an "
                 f"even routing: a rank receives that much per layer on the mean, and up to "
                 f"{format_bytes(rows * lay.ep)} if the router sends it every token (its "
                 f"experts' inputs, saved for backward). Priced at a routing imbalance of "
                 f"{u:g} ({where}): every rank waits for the busiest, whose exchanges carry "
                 f"and whose experts compute {u:g}x the mean's rows.")


def _failures(plan: Plan, est: Estimate) -> Prose:
    """What failures cost the run: the pause a save takes, the job's MTBF, the checkpoint
    interval that loses least (Young/Daly) and the goodput at it and at the plan's
    (`ptc.compiler.cost.goodput`)."""
    rt, gpus = plan.runtime, plan.hardware.num_gpus
    mtbf = job_mtbf(gpus, rt.mtbf)
    source = "the plan's mtbf" if rt.mtbf is not None else \
        f"Llama 3's failure rate per GPU, for {gpus} GPUs"
    if not rt.checkpoint_dir:
        return Prose(f"Failures: the job's MTBF is {format_duration(mtbf)} ({source}); with no "
                     f"checkpoint_dir a failure loses all training since the start.")
    if not rt.async_save:
        return Prose(f"Failures: the job's MTBF is {format_duration(mtbf)} ({source}); saves "
                     f"are synchronous, so a save pauses training for its whole write to "
                     f"storage, which ptc does not predict.")
    profile = plan_profile(plan)
    pause = save_pause(profile, est.layout, plan.hardware, plan_precision(plan, profile))
    best = checkpoint_interval(pause, mtbf)
    step = est.step_time_s
    text = (f"Failures: a save pauses training {format_duration(pause)} (the rank's share of "
            f"masters and optimizer state copied to host memory, written meanwhile); the "
            f"job's MTBF is {format_duration(mtbf)} ({source}). Young/Daly: a save every "
            f"{format_duration(best)} (~{max(1, round(best / step)):,} steps), goodput "
            f"{goodput(best, pause, mtbf):.2%}")
    planned = [t for t in (rt.checkpoint_interval,
                           rt.checkpoint_every * step if isinstance(rt.checkpoint_every, int)
                           else None) if t]
    if rt.checkpoint_every == AUTO:
        text += " (checkpoint_every = auto: the run measures the pause and saves so)"
    elif planned:
        text += (f"; at the plan's save every {format_duration(min(planned))}: "
                 f"{goodput(min(planned), pause, mtbf):.2%}")
    text += ". " + _snapshots(plan, est, best, pause, mtbf)
    return Prose(text)


def _snapshots(plan: Plan, est: Estimate, interval: float, pause: float, mtbf: float) -> str:
    """What in-memory snapshots (`runtime.snapshot_every`) hold per rank and node, whether
    `auto` keeps them (at most a quarter of the node's host memory: tmpfs is half of it by
    default, and they take at most half of that), and the goodput at the Young/Daly
    interval with them."""
    every, hw = plan.runtime.snapshot_every, plan.hardware
    if every is None:
        return "In-memory snapshots: off (snapshot_every = none)."
    profile = plan_profile(plan)
    state = snapshot_bytes(profile, est.layout, plan_precision(plan, profile),
                           plan.train.seq_len)
    node = 2 * state * hw.gpus_per_node
    held = (f"{format_bytes(state)} per rank, twice (its own and a peer's): "
            f"{format_bytes(node)} of the node's {format_bytes(hw.host_memory_bytes)} host "
            f"memory")
    if every == AUTO and not snapshots_fit(node, default_tmpfs(hw.host_memory_bytes)):
        return (f"In-memory snapshots: off (snapshot_every = auto: {held}, more than a quarter "
                f"of it, half of tmpfs).")
    sigma, steps = snapshot_pause(state, hw), 1 if every == AUTO else every
    with_them = snapshot_goodput(interval, pause, sigma, est.step_time_s, mtbf, steps)
    when = "step (snapshot_every = auto)" if every == AUTO else f"{every} steps"
    lost = "half a step" if steps == 1 else f"half of {steps} steps"
    return (f"In-memory snapshots every {when}: {held}; each pauses training "
            f"{format_duration(sigma)} and a failure loses {lost}: goodput "
            f"{with_them:.2%} at the Young/Daly saves ({goodput(interval, pause, mtbf):.2%} "
            f"with storage alone).")


def _power_row(hw: HardwareSpec, dtype: str) -> str:
    """The power limit's row label: what it does to the GEMM rate beside it."""
    if dtype in hw.gemm_flops:
        return "power limit (the measured GEMM rate's)"
    return f"power limit (GEMM clock x {hw.clock_share:.3g})"


def _rates(plan: Plan, est: Estimate) -> FitTable:
    """The figures compute and communication are priced with, and where each comes from: the
    calibration profile the plan names, the preset, or the plan itself; on a GPU priced by
    its SMs, the share of full waves the estimate's layer GEMMs run."""
    hw, dtype = plan.hardware, plan.train.compute_dtype
    try:
        profile = load_profile(hw.profile) if hw.profile else None
    except ProfileError:  # read when the plan was; gone since: its figures are still the plan's
        profile = None
    from_profile = profile.overrides() if profile is not None else {}
    preset = HardwareSpec.preset(hw.gpu) if hw.gpu in PRESETS else None

    def origin(name: str, value) -> str:
        given = from_profile.get(name)
        if name in ("intra", "inter") and given is not None:
            given = LinkSpec(bandwidth=given[0], latency=given[1])
        if name == "gemm_flops" and given is not None:
            return f"profile {hw.profile}" if dtype in given and given[dtype] == value else \
                "plan"
        if given is not None and given == value:
            return f"profile {hw.profile}"
        if preset is not None and getattr(preset, name) == value:
            return f"preset {hw.gpu}"
        return "plan"

    title = "Rates the step is priced with"
    if profile is not None:
        info = profile.info
        title += (f" (profile {hw.profile}: measured on {info.get('device_name', profile.device)}"
                  f" by {info.get('world_size', 1)} processes at once, {info.get('created', '')})")
    table = FitTable(title=title)
    for name in ("figure", "value", "from"):
        table.add_column(name, justify="right" if name == "value" else "left")
    gemm_source = origin("gemm_flops", hw.gemm_flops.get(dtype)) if dtype in hw.gemm_flops \
        else origin("achievable_fraction", hw.achievable_fraction)
    capped = f" x {hw.clock_share:.3g}" if hw.power_limit is not None else ""
    gemm_how = "" if dtype in hw.gemm_flops else \
        f" (peak x {hw.achievable_fraction:g}{capped})"
    rate = hw.gemm_rate(dtype)
    shown = f"{rate / 1e12:,.4g} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:,.4g} GFLOP/s"
    table.add_row(f"GEMM ({dtype})", shown + gemm_how, gemm_source)
    if hw.attention_fraction is not None:
        table.add_row(f"fused attention kernel ({dtype})",
                      f"{hw.attention_rate(dtype) / 1e12:,.4g} TFLOP/s "
                      f"(peak x {hw.attention_fraction:g}{capped})",
                      origin("attention_fraction", hw.attention_fraction))
    if hw.power_limit is not None:
        table.add_row(_power_row(hw, dtype), f"{hw.power_limit:g} W of {hw.board_power:g} W",
                      origin("power_limit", hw.power_limit))
    sms = rates(hw, plan.train.dtype).multiprocessors
    if sms:
        lay, layer_profile = est.layout, plan_profile(plan)
        split = Split(tp=lay.tp, kv_divisor=layer_profile.kv_divisor(lay.tp), sp=lay.sp, cp=lay.cp)
        forward, backward = (tile_efficiency(layer_profile, "layer", phase, lay.micro_batch,
                                             lay.rank_seq(plan.train.seq_len), split, sms)
                             for phase in ("fwd", "bwd"))
        table.add_row(f"a layer's GEMM waves used ({sms} SMs)",
                      f"{forward:.1%} forward, {backward:.1%} backward",
                      origin("multiprocessors", hw.multiprocessors))
    if hw.contention:
        table.add_row("SMs a collective holds (compute beside it runs on the rest)",
                      f"{hw.comm_multiprocessors} of {hw.multiprocessors}: "
                      f"{hw.contention:.1%} of each hidden second",
                      origin("comm_multiprocessors", hw.comm_multiprocessors))
    fused = plan.runtime.compile
    table.add_row("memory-bound ops" + (" (chains fused: runtime.compile)" if fused else
                                        " (each op a kernel)"),
                  f"{hw.mem_bandwidth / 1e9:,.4g} GB/s", origin("mem_bandwidth", hw.mem_bandwidth))
    unit = "kernel" if fused else "op"
    table.add_row(f"dispatch per {unit}" + (f" (added to each {unit})" if hw.synchronous else
                                            " (hidden behind longer kernels)"),
                  format_seconds(hw.dispatch_overhead),
                  origin("dispatch_overhead", hw.dispatch_overhead))
    for name in ("intra", "inter"):
        link = getattr(hw, name)
        table.add_row(f"{name}-node link", f"{format_seconds(link.latency)} + "
                      f"{link.bandwidth / 1e9:,.4g} GB/s", origin(name, link))
    return table


def render_search(plan: Plan, top: int = 5) -> Group:
    """The `top` fastest layouts of `plan` that fit, and the nearest misses."""
    result = search_all(plan, top)
    table = FitTable(title=f"Fastest layouts ({result.fitting} of {result.candidates} fit)")
    for name in ("#", "layout", "step", "tokens/s", "MFU", "peak mem", *PARTS):
        table.add_column(name, justify="left" if name == "layout" else "right")
    for rank, (_, est) in enumerate(result.ranked, 1):
        table.add_row(str(rank), describe_layout(est.layout), format_seconds(est.step_time_s),
                      f"{est.tokens_per_s:,.0f}", f"{est.mfu:.1%}",
                      format_bytes(est.peak_memory_bytes),
                      *(format_seconds(est.breakdown[p]) for p in PARTS))
    misses = FitTable(title=f"Nearest layouts that do not fit ({len(result.rejected)} rejected)")
    misses.add_column("layout")
    misses.add_column("peak", justify="right")
    misses.add_column("over by", justify="right")
    for rej in result.rejected[:top]:
        misses.add_row(describe_layout(rej.layout), format_bytes(rej.peak_bytes),
                       format_bytes(rej.over_bytes))
    return Group(table, misses)


def _overlap(plan: Plan, est: Estimate) -> Group:
    """The dp communication buckets of the first (and last) pipeline stage, what overlaps, and
    the dtype the gradients travel in.

    Runs of buckets that carry one layer each collapse into one row.
    """
    layout, par = est.layout, plan.parallel
    profile = plan_profile(plan)
    link = dp_link(plan)
    by_stage = {stage: predicted_buckets(plan, profile, layout, stage)
                for stage in sorted({0, layout.pp - 1})}
    size = by_stage[0][0]
    how = "auto = min(9 x latency x bandwidth of the dp link, largest unit)" \
        if par.bucket_size == "auto" else "set in the plan"
    collective = {3: "2 gathers + reduce-scatter", 2: "reduce-scatter",
                  1: "reduce-scatter (once per step)"}.get(par.zero, "all-reduce (once per step)")
    table = FitTable(title=f"Communication buckets over dp: bucket_size {format_bytes(size)} "
                        f"({how}; dp link {format_bytes(link.bandwidth)}/s, "
                        f"{format_seconds(link.latency)}). {_overlap_summary(plan)}")
    for name in ("stage", "buckets", "carries", "fp32 grad each", f"{collective} each"):
        table.add_column(name, justify="left" if name == "carries" else "right")
    for stage, (_, buckets) in by_stage.items():
        for run in _layer_runs(buckets):
            carries = " + ".join(run[0].items) if len(run) == 1 else \
                "layers " + _ranges([int(b.items[0].split(".")[1]) for b in run]) + \
                ", one each"
            table.add_row(str(stage), str(len(run)), carries, format_bytes(run[0].grad_bytes),
                          format_seconds(run[0].seconds))
    buckets = {stage: found for stage, (_, found) in by_stage.items()}
    return Group(table, _grad_wire(plan, layout, buckets))


WIRE_FORMATS = {"fp8": "e4m3", "fp8_e5m2": "e5m2"}
"""`parallel.grad_comm` -> the float8 format gradients travel in (`ptc.ops.fp8_comm.FORMATS`)."""


def _grad_wire(plan: Plan, layout: Layout, by_stage: dict[int, list[PredictedBucket]]) -> Prose:
    """The dtype the dp gradient reductions travel in and the bytes the most loaded stage shown
    reduces; with float8 on the wire (`parallel.grad_comm`), the bytes that saves a step.

    The figures are those the estimate prices: the predicted buckets' gradients (sized in
    fp32) at `Plan.grad_wire_bytes` an element, as many times a step as the ZeRO stage
    reduces (ZeRO 2-3 every micro-batch).
    """
    par, kept = plan.parallel, plan.train.grad_dtype
    if dp_group(plan).size == 1:
        return Prose("No gradient reduction over dp (dp = 1): each rank keeps its gradients.")
    stage, buckets = max(by_stage.items(), key=lambda item: sum(b.grad_bytes for b in item[1]))
    elements = sum(b.grad_bytes for b in buckets) // GRAD_BYTES
    wire, full = plan.grad_wire_bytes, DTYPE_BYTES[kept]
    times = layout.microbatches if par.zero >= 2 else 1
    when = "once per step" if times == 1 else f"every micro-batch, {times} a step"
    moved = f"stage {stage} reduces {format_bytes(elements * wire)} a rank"
    if par.grad_comm == "none":
        return Prose(f"Gradients cross dp in {kept} (train.grad_dtype), {full} bytes an "
                     f"element: {moved}, {when}.")
    return Prose(f"Gradients cross dp in fp8 {WIRE_FORMATS[par.grad_comm]} (parallel.grad_comm "
                 f"= {par.grad_comm}: one fp32 scale per bucket and rank, summed in fp32 on "
                 f"arrival), {wire} byte an element instead of {kept}'s {full}: {moved} instead "
                 f"of {format_bytes(elements * full)}, {when}; "
                 f"{format_bytes(elements * (full - wire) * times)} less a step.")


def _overlap_summary(plan: Plan) -> str:
    """What overlaps what, in one sentence, as the comm_overlap pass and runtime do it."""
    par = plan.parallel
    if not par.overlap:
        return "Overlap off: every collective is waited for as soon as it is issued."
    if par.zero == 3:
        text = ("Each layer's gather starts while the previous layer computes (forward and "
                "backward)")
    else:
        text = "Each bucket's reduction starts as soon as its last gradient is accumulated"
    text += f"; up to {IN_FLIGHT} gradient reductions run behind backward"
    if par.tp > 1:
        text += "; tp input-gradient reductions run under the weight gradients"
    return text + "."


def _layer_runs(buckets: list[PredictedBucket]) -> list[list[PredictedBucket]]:
    """Consecutive buckets grouped: one-layer buckets of equal size share a run."""
    def one_layer(bucket: PredictedBucket) -> bool:
        return len(bucket.items) == 1 and bucket.items[0].startswith("layers.")

    runs: list[list[PredictedBucket]] = []
    for bucket in buckets:
        last = runs[-1][-1] if runs else None
        if last is not None and one_layer(bucket) and one_layer(last) \
                and last.grad_bytes == bucket.grad_bytes:
            runs[-1].append(bucket)
        else:
            runs.append([bucket])
    return runs
