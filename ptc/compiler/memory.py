"""Peak memory of each pipeline stage's most loaded rank, as a sympy expression.

Terms per stage (bytes, one tp/dp rank of that stage):
- `weights`, `grads`, `optimizer`: model state. Mixed-precision Adam keeps a
  16-bit weight and gradient and 12 bytes of fp32 master weight, momentum and
  variance per parameter (2 + 2 + 12 = 16); fp32 training keeps 4 + 4 + 8
  (the weights are their own master). ZeRO-1 divides the optimizer state by
  d, ZeRO-2 the gradients too, ZeRO-3 the weights too. Tensor parallelism
  divides the split parameters by t; norms, row-parallel biases and learned
  positions stay whole. The embedding sits on the first stage, final norm and
  head on the last; a tied head is a second copy of the embedding there when
  p > 1. Adam also keeps a 4-byte step counter per parameter tensor.
- `activations`: per layer, the graph-derived saved bytes of `profile`
  (tp-class / t; seq-class / t with sequence parallelism; batch-free whole),
  less the attention core under selective recompute, or only the layer's
  output under full recompute; times the micro-batches the schedule keeps in
  flight on that stage: GPipe m; 1F1B min(p - i, m) for stage i; interleaved
  min(2(p - 1 - i) + (v - 1)p + 1, m·v) chunks of L/(p·v) layers (for stage 0:
  L·(1 + (p - 1)/(p·v)) layers' worth, Korthikanti et al.).
- `recompute`: the working set of recomputing one layer in backward.
- `buffers`: communication buffers — pipeline send/receive of one boundary
  activation each way, the sequence-parallel all-gather output, two data-
  parallel gradient buckets, ZeRO-3's gathered parameters of two layers
  (the current and the prefetched one) — and the runtime's own reserve.

The same code builds the expression (with sympy symbols b, s, t, d, m) and
the number (with ints): `stage_memory_terms` is written in plain arithmetic
over whichever it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import sympy

from ptc.compiler.layout import Layout
from ptc.compiler.profile import ModelProfile, b, s

t, d, m = sympy.symbols("t d m", positive=True, integer=True)
"""Symbols of the tp degree, dp degree and micro-batches per step."""

RUNTIME_RESERVE = 1 << 30
"""Bytes the runtime holds beside the model: CUDA context, cuBLAS and NCCL workspaces."""
GRAD_BUCKET_ELEMENTS = 25 * 2**20
"""Elements of one data-parallel gradient bucket (torch DDP's 25 MiB cap, in elements)."""

TERMS = ("weights", "grads", "optimizer", "activations", "recompute", "buffers")
"""Names of the memory terms, in display order."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Precision:
    """Bytes per parameter element of each kind of model state."""

    weight: int
    """Working weight (compute dtype)."""
    grad: int
    """Gradient (compute dtype)."""
    optimizer: int
    """Optimizer state incl. the fp32 master copy when weights are 16-bit."""


def precision(dtype_bytes: int, optimizer: str, momentum: float = 0.0) -> Precision:
    """Model-state bytes for a compute dtype width and optimizer ("adamw", "sgd")."""
    master = 4 if dtype_bytes < 4 else 0
    states = 8 if optimizer == "adamw" else (4 if momentum else 0)
    return Precision(weight=dtype_bytes, grad=dtype_bytes, optimizer=master + states)


def in_flight(layout: Layout, stage: int, mn: Callable) -> tuple:
    """(units in flight, layers per unit) on `stage`: micro-batches or interleaved chunks."""
    p, v, layers = layout.pp, layout.vstages, len(layout.checkpoint)
    mb = m if mn is sympy.Min else layout.microbatches
    if layout.schedule == "gpipe":
        return mb, layers // p
    if layout.schedule == "1f1b":
        return mn(p - stage, mb), layers // p
    return mn(2 * (p - 1 - stage) + (v - 1) * p + 1, mb * v), layers // (p * v)


def stage_params(profile: ModelProfile, layout: Layout, stage: int) -> tuple[int, int, int]:
    """(tp-split elements, replicated elements, tensors) of the parameters `stage` holds."""
    pr, layers = profile.params, len(layout.stage_layers(stage))
    split, whole = pr["layer"].split * layers, pr["layer"].replicated * layers
    tensors = pr["layer"].tensors * layers
    if stage == 0:
        split, whole, tensors = split + pr["pre"].split, whole + pr["pre"].replicated, \
            tensors + pr["pre"].tensors
    if stage == layout.pp - 1:
        split, whole, tensors = split + pr["post"].split, whole + pr["post"].replicated, \
            tensors + pr["post"].tensors
        if profile.tied and layout.pp > 1:  # the head's own copy of the tied embedding
            split, tensors = split + profile.tied_elements, tensors + 1
    return split, whole, tensors


def stage_memory_terms(profile: ModelProfile, layout: Layout, stage: int, prec: Precision,
                       *, bb, ss, tt, dd, mn: Callable = min) -> dict[str, object]:
    """The memory terms of pipeline `stage` (see module docstring).

    `bb, ss, tt, dd` are b, s, t, d as numbers, or as sympy symbols (with
    `mn=sympy.Min`) to get the expression.
    """
    f, p, zero = profile.fn, layout.pp, layout.zero
    first, last = stage == 0, stage == p - 1
    seq_div = tt if layout.sp else 1
    mb = m if mn is sympy.Min else layout.microbatches

    # --- model state
    split, whole, tensors = stage_params(profile, layout, stage)
    n = split / tt + whole
    weights = prec.weight * n / (dd if zero >= 3 else 1)
    grads = prec.grad * n / (dd if zero >= 2 else 1)
    counters = 4 * tensors if prec.optimizer else 0
    optimizer = (prec.optimizer * n + counters) / (dd if zero >= 1 else 1)

    # --- activations
    def act(region: str, policy: str) -> object:
        if policy == "full":
            region = "out"
        full = f[f"{region}.tp"](bb, ss) / tt + f[f"{region}.seq"](bb, ss) / seq_div \
            + f[f"{region}.const"](bb, ss)
        if policy != "selective":
            return full
        return full - (f[f"{region}.core_tp"](bb, ss) / tt
                       + f[f"{region}.core_seq"](bb, ss) / seq_div + f[f"{region}.core_const"](bb, ss))

    units, per_unit = in_flight(layout, stage, mn)
    policies = [layout.checkpoint[i] for i in layout.stage_layers(stage)]
    # Layers of one stage are alike; the mean per-layer footprint times the layers in flight.
    per_layer = sum(act("layer", pol) for pol in policies) / len(policies)
    activations = units * per_unit * per_layer
    micro_in_flight = units if layout.schedule != "interleaved" else mn(p - stage, mb)
    if first:
        activations += micro_in_flight * act("pre", "none")
    if last:
        activations += (1 if layout.schedule != "gpipe" else units) * act("post", "none")
    recompute = 0
    if "full" in policies:
        recompute = act("layer", "none")
    elif "selective" in policies:
        recompute = act("layer", "none") - act("layer", "selective")

    # --- buffers
    boundary = prec.weight * f["boundary"](bb, ss)
    buffers = RUNTIME_RESERVE
    if p > 1:
        buffers += 2 * boundary / seq_div
    if layout.sp:
        buffers += boundary
    if layout.dp > 1:
        buffers += 2 * GRAD_BUCKET_ELEMENTS * prec.grad
    if zero >= 3:
        layer = profile.params["layer"]
        buffers += 2 * prec.weight * (layer.split / tt + layer.replicated)
    return dict(weights=weights, grads=grads, optimizer=optimizer, activations=activations,
                recompute=recompute, buffers=buffers)


def stage_memory(profile: ModelProfile, layout: Layout, prec: Precision, seq_len: int
                 ) -> list[dict[str, float]]:
    """Memory terms of every pipeline stage, in bytes."""
    return [{k: float(v) for k, v in stage_memory_terms(
        profile, layout, i, prec, bb=layout.micro_batch, ss=seq_len, tt=layout.tp,
        dd=layout.dp).items()} for i in range(layout.pp)]


def stage_memory_expr(profile: ModelProfile, layout: Layout, prec: Precision, stage: int
                      ) -> dict[str, sympy.Expr]:
    """Memory terms of `stage` as sympy expressions in b, s, t, d, m."""
    terms = stage_memory_terms(profile, layout, stage, prec, bb=b, ss=s, tt=t, dd=d, mn=sympy.Min)
    return {k: sympy.nsimplify(v) if not isinstance(v, sympy.Expr) else sympy.simplify(v)
            for k, v in terms.items()}


def peak(terms: dict[str, float]) -> float:
    """Peak bytes of one stage: the sum of its terms."""
    return sum(terms.values())
