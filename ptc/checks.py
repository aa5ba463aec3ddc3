"""Semantic checks that tie plan sections together.

Each section validates its own fields; the rules here need two or more
sections at once: the mesh must use exactly the GPUs there are, heads must
split evenly over tp, layers over pipeline chunks, the batch over
micro-batches and data-parallel ranks. Every rule reports through a
`DiagnosticSink` with the field's place in the file, so all problems of a
plan come out together. Errors say which factors disagree; warnings (tp
spanning nodes) leave the plan valid.
"""

from __future__ import annotations

from math import isqrt, prod
from typing import TYPE_CHECKING

from ptc.errors import DiagnosticSink, Span

if TYPE_CHECKING:
    from ptc.plan import Plan


def _span(section: object, name: str) -> Span | None:
    return (getattr(section, "spans", None) or {}).get(name)


def check_plan(plan: Plan, sink: DiagnosticSink) -> None:
    """Record in `sink` every cross-section problem of `plan`."""
    _check_mesh(plan, sink)
    _check_model_split(plan, sink)
    _check_batch(plan, sink)
    _check_schedule(plan, sink)
    _check_grad_dtype(plan, sink)
    _check_tp_comm(plan, sink)
    _check_expert_parallel(plan, sink)
    _check_pipeline(plan, sink)
    _check_hardware_fit(plan, sink)


def _check_mesh(plan: Plan, sink: DiagnosticSink) -> None:
    par, hw = plan.parallel, plan.hardware
    degrees = {a: par.degree(a) for a in ("tp", "cp", "pp", "dp")}
    known = {a: d for a, d in degrees.items() if d != "auto"}
    gpus = hw.num_gpus
    gpu_text = f"{gpus} GPUs (nodes({hw.nodes}) * gpus_per_node({hw.gpus_per_node}))"
    factors = " * ".join(f"{a}({d})" for a, d in degrees.items() if a != "cp" or d != 1)
    if len(known) == len(degrees):
        total = prod(known.values())
        if total != gpus:
            sink.error(f"{factors} = {total} != {gpu_text}", field="parallel.tp",
                       span=_span(par, "tp") or _span(par, "pp") or _span(par, "dp"))
    elif known and gpus % prod(known.values()):
        fixed = " * ".join(f"{a}({d})" for a, d in known.items())
        sink.error(f"{fixed} = {prod(known.values())} does not divide {gpu_text}, "
                   f"so no value of the auto axes fits", field="parallel",
                   span=next((_span(par, a) for a in known if _span(par, a)), None))
    tp = degrees["tp"]
    if tp != "auto" and tp > hw.gpus_per_node:
        sink.warning(f"tp({tp}) > gpus_per_node({hw.gpus_per_node}): each tp group spans "
                     f"nodes and its collectives run at the inter-node link speed",
                     field="parallel.tp", span=_span(par, "tp"))
    cp, seq = degrees["cp"], plan.train.seq_len
    if cp != "auto" and cp > 1 and seq % (2 * cp):
        sink.error(f"seq_len({seq}) is not divisible by 2 * cp({cp}) = {2 * cp}: context "
                   f"parallelism gives each rank two of 2·cp equal chunks of the sequence",
                   field="parallel.cp", span=_span(par, "cp"),
                   choices=tuple(str(d) for d in _divisors(seq) if seq % (2 * d) == 0))
    if par.sequence_parallel and tp == 1:
        sink.warning("sequence_parallel has no effect with tp = 1",
                     field="parallel.sequence_parallel", span=_span(par, "sequence_parallel"))


def _check_model_split(plan: Plan, sink: DiagnosticSink) -> None:
    model, par = plan.model, plan.parallel
    if model.family == "custom":
        return
    tp = par.tp
    if model.hidden % model.heads:
        sink.error(f"hidden({model.hidden}) is not divisible by heads({model.heads})",
                   field="model.hidden", span=_span(model, "hidden"))
    kv = model.num_kv_heads
    if model.heads % kv:
        sink.error(f"heads({model.heads}) is not divisible by kv_heads({kv})",
                   field="model.kv_heads", span=_span(model, "kv_heads"))
    if tp != "auto":
        if model.heads % tp:
            sink.error(f"heads({model.heads}) is not divisible by tp({tp})",
                       field="parallel.tp", span=_span(par, "tp"),
                       choices=tuple(str(d) for d in _divisors(model.heads)))
        if not model.kv_heads_fit(tp):
            why = "neither divides the other, so kv heads can be neither split nor replicated " \
                "evenly" if kv % tp and tp % kv else "gpt's fused qkv projection cannot " \
                "replicate kv heads over more ranks than it has"
            sink.error(f"kv_heads({kv}) and tp({tp}): {why}", field="parallel.tp",
                       span=_span(par, "tp"), choices=tuple(str(d) for d in _divisors(kv)))
        if model.ffn_size % tp:
            sink.error(f"ffn({model.ffn_size}) is not divisible by tp({tp})",
                       field="parallel.tp", span=_span(par, "tp"))
    pp, v = par.pp, par.virtual_stages
    ends = par.first_stage_layers is not None or par.last_stage_layers is not None
    if pp != "auto" and (ends or par.pins_layers and model.layers % (pp * v)):
        # A cut at "norm" leaves the estimate unpriced, not the plan invalid: checked only
        # where the cuts must say how the layers split.
        if not par.stage_boundaries or len(par.stage_boundaries) == pp * v - 1:
            par.stage_layers(model.layers, sink)  # a wrong count is _check_pipeline's
    elif pp != "auto" and model.layers % (pp * v):
        sink.error(f"layers({model.layers}) is not divisible by pp({pp}) * "
                   f"virtual_stages({v}) = {pp * v}; give the uneven split "
                   f"(first_stage_layers, last_stage_layers or stage_boundaries)",
                   field="parallel.pp", span=_span(par, "pp") or _span(par, "virtual_stages"))
    if plan.train.seq_len > model.max_seq:
        sink.error(f"seq_len({plan.train.seq_len}) > model max_seq({model.max_seq})",
                   field="train.seq_len", span=_span(plan.train, "seq_len"))
    ckpt = par.checkpoint
    if isinstance(ckpt, tuple) and len(ckpt) != model.layers:
        sink.error(f"per-layer checkpoint lists {len(ckpt)} entries for {model.layers} layers",
                   field="parallel.checkpoint", span=_span(par, "checkpoint"))


def _check_schedule(plan: Plan, sink: DiagnosticSink) -> None:
    train, schedule = plan.train, plan.train.lr_schedule
    if isinstance(train.steps, int) and schedule.warmup >= train.steps > 0:
        sink.warning(f"warmup({schedule.warmup}) >= steps({train.steps}): the run ends while "
                     f"the learning rate still warms up, at {train.steps / schedule.warmup:.0%} "
                     "of lr", field="train.lr_schedule.warmup", span=_span(schedule, "warmup"))


def _check_batch(plan: Plan, sink: DiagnosticSink) -> None:
    train, par = plan.train, plan.parallel
    dp = par.dp
    if dp == "auto":
        return
    per_step = train.micro_batch * dp
    if train.global_batch % per_step:
        sink.error(f"global_batch({train.global_batch}) is not divisible by "
                   f"micro_batch({train.micro_batch}) * dp({dp}) = {per_step}",
                   field="train.global_batch", span=_span(train, "global_batch"))
    elif par.microbatches is not None and par.microbatches * per_step != train.global_batch:
        sink.error(f"microbatches({par.microbatches}) * micro_batch({train.micro_batch}) * "
                   f"dp({dp}) = {par.microbatches * per_step} != global_batch"
                   f"({train.global_batch})", field="parallel.microbatches",
                   span=_span(par, "microbatches"))


def _check_grad_dtype(plan: Plan, sink: DiagnosticSink) -> None:
    train, par = plan.train, plan.parallel
    if train.grad_dtype != "fp32" and par.zero == 3:
        sink.error(f"grad_dtype = {train.grad_dtype} needs zero 0-2: ZeRO-3 reduce-scatters "
                   f"each layer's gradient into its fp32 master shard", field="train.grad_dtype",
                   span=_span(train, "grad_dtype"), choices=("fp32",))
    if par.grad_comm != "none" and par.zero == 3:
        sink.error(f"grad_comm = {par.grad_comm} needs zero 0-2: ZeRO-3's gradients are "
                   f"reduce-scattered inside the graph, per layer", field="parallel.grad_comm",
                   span=_span(par, "grad_comm"), choices=("none",))


def _check_tp_comm(plan: Plan, sink: DiagnosticSink) -> None:
    """tp_comm = async takes sequence parallelism's collectives apart beside their GEMMs:
    it needs them (sequence_parallel) and the overlap that runs them."""
    par = plan.parallel
    if par.tp_comm != "async":
        return
    why = None
    if not par.sequence_parallel:
        why = "needs sequence_parallel = true: it overlaps sequence parallelism's all-gathers " \
              "and reduce-scatters with the GEMMs they feed"
    elif not par.overlap:
        why = "needs overlap = true"
    if why:
        sink.error(f"tp_comm = async {why}", field="parallel.tp_comm",
                   span=_span(par, "tp_comm"), choices=("sync",))


def _check_expert_parallel(plan: Plan, sink: DiagnosticSink) -> None:
    """ep folds expert shards from the ranks that hold other tokens of the same weights
    (dp·cp): it must divide them. Whether it divides each layer's experts is known once the
    model is captured (`ptc.passes.shard_experts`)."""
    par = plan.parallel
    if par.ep == 1 or not isinstance(par.ep, int):
        return
    ranks = plan.grad_ranks
    if ranks != "auto" and ranks % par.ep:
        dividers = tuple(str(d) for d in range(1, ranks + 1) if ranks % d == 0)
        sink.error(f"ep({par.ep}) must divide dp({par.dp}) * cp({par.cp}) = {ranks}: the "
                   f"expert shards are folded from those ranks", field="parallel.ep",
                   span=_span(par, "ep"), choices=dividers)
    if par.offload != "none":
        sink.error(f"ep({par.ep}) with offload = {par.offload} is not supported: the host "
                   f"update gathers every unit over dp, and expert units are sharded over the "
                   f"ranks holding the same experts", field="parallel.offload",
                   span=_span(par, "offload"), choices=("none",))


def _check_pipeline(plan: Plan, sink: DiagnosticSink) -> None:
    par = plan.parallel
    if par.splits_backward and par.pp != 1:
        _check_split_backward(plan, sink)
    cuts = par.pp * par.virtual_stages - 1 if par.pp != "auto" else None
    if par.stage_boundaries and cuts is not None and len(par.stage_boundaries) != cuts:
        sink.error(f"stage_boundaries lists {len(par.stage_boundaries)} cuts; pp({par.pp}) * "
                   f"virtual_stages({par.virtual_stages}) stages have {cuts}",
                   field="parallel.stage_boundaries", span=_span(par, "stage_boundaries"))
    for name in ("first_stage_layers", "last_stage_layers"):
        if getattr(par, name) is not None and (par.pp == "auto" or par.stage_boundaries):
            why = "a fixed pp" if par.pp == "auto" else "no stage_boundaries (both place cuts)"
            sink.error(f"{name} needs {why}", field=f"parallel.{name}", span=_span(par, name))
    if par.pp == "auto" or par.pp == 1 or par.dp == "auto":
        return
    m = plan.num_microbatches
    if par.schedule in ("1f1b", "interleaved", "zero_bubble") and m < par.pp:
        sink.error(f"schedule {par.schedule} needs at least pp({par.pp}) micro-batches, "
                   f"got {m}", field="parallel.microbatches",
                   span=_span(par, "microbatches") or _span(par, "schedule") or _span(par, "pp"))
    if par.schedule == "dualpipev" and m < 2 * par.pp:
        sink.error(f"schedule dualpipev needs at least 2 * pp({par.pp}) = {2 * par.pp} "
                   f"micro-batches, one per stage, got {m}", field="parallel.microbatches",
                   span=_span(par, "microbatches") or _span(par, "schedule") or _span(par, "pp"))
    if par.virtual_stages > 1 and m % par.pp and not par.v_shaped:
        sink.error(f"the {par.schedule} schedule with virtual_stages({par.virtual_stages}) "
                   f"needs micro-batches({m}) divisible by pp({par.pp})",
                   field="parallel.microbatches",
                   span=_span(par, "microbatches") or _span(par, "schedule"))


def _check_split_backward(plan: Plan, sink: DiagnosticSink) -> None:
    """What a zero-bubble schedule's backward in two (I, then W) cannot run with yet."""
    par, runtime = plan.parallel, plan.runtime
    if runtime.compile:
        sink.error(f"schedule {par.schedule} needs runtime.compile = false: a compiled stage's "
                   "backward is one kernel graph, which cannot run its weight gradients apart",
                   field="runtime.compile", span=_span(runtime, "compile"), choices=("false",))


def _check_hardware_fit(plan: Plan, sink: DiagnosticSink) -> None:
    train, peaks, gpu = plan.train, plan.hardware.peak_flops, plan.hardware.gpu
    missing = []
    if train.compute_dtype not in peaks:
        missing.append(f"train dtype {train.dtype} has no peak in hardware {gpu}"
                       if train.dtype == train.compute_dtype else
                       f"train dtype fp8 computes in bf16, which has no peak in hardware {gpu}")
    # The float8 GEMMs are priced at the fp8 peak; emulated ones at the compute dtype's.
    if train.dtype == "fp8" and not train.fp8_emulate and "fp8" not in peaks:
        missing.append(f"train dtype fp8 has no fp8 peak in hardware {gpu}; give one in "
                       "peak, or set train.fp8_emulate = true")
    for message in missing:
        sink.error(message, field="train.dtype", span=_span(train, "dtype"),
                   choices=tuple(peaks))


_MAX_DIVISOR_SEARCH = 10**10
"""Above this, listing the divisors of a (surely mistyped) count is not worth the time."""


def _divisors(n: int) -> list[int]:
    if n > _MAX_DIVISOR_SEARCH:
        return []
    # Trial division up to sqrt(n): a plan file can hold a huge head count.
    small = [d for d in range(1, isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
