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
  L·(1 + (p - 1)/(p·v)) layers' worth, Korthikanti et al.). The tensors
  between layers are kept by whoever needs them (`_chunk_ends`): the next
  layer's checkpoint, the pipeline runtime (a stage's output), or a node
  that saves them.
- `recompute`: the working set of the backward beyond what is saved:
  recomputing one layer, or on the stage holding the loss the loss's own
  backward (two float32 gradients of the logits, `_loss_gradients`),
  whichever is larger (the loss's runs first, before any layer's).
- with optimizer offload (`Layout.offload`) the `optimizer` term is 0: the
  fp32 masters, the moments and the step counters live in host memory,
  beside an fp32 copy of the rank's gradient shard that the CPU step reads
  (`stage_host_bytes`, `offloaded_per_element`). The device keeps its
  weights and gradients as without offload (at ZeRO-3 the fp32 shard the
  graph gathers stays on the device: it is the weight).
- `buffers`: communication buffers — pipeline send/receive of one boundary
  activation each way, the sequence-parallel all-gather output, two data-
  parallel gradient buckets, ZeRO-3's gathered parameters of two layers
  (the current and the prefetched one; under a split backward also those each
  micro-batch re-gathers in its I and keeps until its W) — and the runtime's own
  reserve.

The same code builds the expression (with sympy symbols b, s, t, d, m) and
the number (with ints): `stage_memory_terms` is written in plain arithmetic
over whichever it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import sympy

from ptc.compiler.records.layout import Layout
from ptc.compiler.profile.types import ModelProfile, b, s
from ptc.compiler.schedule.build import simulated, stage_peaks
from ptc.errors import CompileError
from ptc.plan import GPU_RUNTIME_RESERVE, SPLIT_BACKWARD, V_SHAPED

t, d, m = sympy.symbols("t d m", positive=True, integer=True)
"""Symbols of the tp degree, dp degree and micro-batches per step."""

GRAD_BUCKET_ELEMENTS = 25 * 2**20
"""Elements of one data-parallel gradient bucket (torch DDP's 25 MiB cap, in elements)."""

TERMS = ("weights", "grads", "optimizer", "activations", "recompute", "buffers")
"""Names of the memory terms, in display order."""

MAIN_GRAD_BYTES = 4
"""Bytes of a main-gradient element: fp32 (Megatron-LM's main_grad, torchtitan's fp32 reduce)."""
MASTER_BYTES = 4
"""Bytes of a master-weight element: fp32."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Precision:
    """Bytes per parameter element of each kind of model state, and what a rank holds beside
    the model."""

    weight: int
    """Working weight (compute dtype)."""
    grad: int
    """Gradient as accumulated over micro-batches and reduced over dp (`train.grad_dtype`)."""
    optimizer: int
    """Optimizer state incl. the fp32 master copy when weights are 16-bit."""
    grad_wire: int = MAIN_GRAD_BYTES
    """Gradient bytes per element in the data-parallel reduction (`Plan.grad_wire_bytes`)."""
    reserve: float = GPU_RUNTIME_RESERVE
    """Bytes a rank holds beside the model (`HardwareSpec.runtime_reserve`): the plan's
    hardware, so it travels with the other per-plan figures."""

    @property
    def main_grad(self) -> int:
        """The fp32 copy of a 16-bit gradient the optimizer steps the masters from (0: the
        gradient is fp32 and the masters read it in place)."""
        return MAIN_GRAD_BYTES if self.grad < MAIN_GRAD_BYTES else 0



def precision(dtype_bytes: int, optimizer: str, momentum: float = 0.0,
              grad_bytes: int = MAIN_GRAD_BYTES, grad_wire: int | None = None,
              reserve: float = GPU_RUNTIME_RESERVE) -> Precision:
    """Model-state bytes for a compute dtype width, optimizer ("adamw", "sgd") and gradient
    width (`train.grad_dtype`: fp32 main gradients unless the plan says otherwise);
    `grad_wire`: bytes a gradient element takes in the dp reduction (default: its width);
    `reserve`: what a rank holds beside the model (`HardwareSpec.runtime_reserve`)."""
    master = 4 if dtype_bytes < 4 else 0
    states = 8 if optimizer == "adamw" else (4 if momentum else 0)
    return Precision(weight=dtype_bytes, grad=grad_bytes, optimizer=master + states,
                     grad_wire=grad_bytes if grad_wire is None else grad_wire, reserve=reserve)


def in_flight(layout: Layout, stage: int, mb, mn: Callable = min) -> tuple:
    """(units in flight, layers per unit) on `stage`: micro-batches or interleaved chunks.

    `mb` is the number of micro-batches per step (or the symbol m, with `mn=sympy.Min`).
    Layers per unit are the stage's own (`Layout.chunk_layers` may make stages uneven).
    """
    p, v, layers = layout.pp, layout.vstages, len(layout.stage_layers(stage))
    if layout.schedule == "gpipe":
        return mb, layers
    # Zero bubble keeps on every rank what its base schedule keeps on the first
    # (`ptc.compiler.schedule.build`): a micro-batch's activations stay until its W.
    first = 0 if layout.schedule == "zero_bubble" else stage
    if layout.schedule in V_SHAPED:  # ZB-V: 1F1B's first rank's p micro-batches, as 2p
        # half-chunks; DualPipeV one more (it needs m >= 2p)
        units = mn(2 * p, 2 * mb) if layout.schedule == "zbv" else 2 * p + 1
        return units, sympy.Rational(layers, 2) if layers % 2 else layers // 2
    if v == 1 and layout.schedule in ("1f1b", "zero_bubble"):
        return mn(p - first, mb), layers
    # Uneven chunks of one rank: their mean (exact when they are alike).
    per_chunk = layers // v if layers % v == 0 else sympy.Rational(layers, v)
    return mn(2 * (p - 1 - first) + (v - 1) * p + 1, mb * v), per_chunk


def stage_params(profile: ModelProfile, layout: Layout, stage: int) -> tuple[int, int, int]:
    """(tp-split elements, replicated elements, tensors) of the parameters `stage` holds;
    key/value projections count as replicated when tp exceeds their heads."""
    pr, layers = profile.params, len(layout.stage_layers(stage))
    split, whole = layer_params(profile, layout.tp)
    split, whole = split * layers, whole * layers
    tensors = pr["layer"].tensors * layers
    if stage == 0:
        split, whole, tensors = split + pr["pre"].split, whole + pr["pre"].replicated, \
            tensors + pr["pre"].tensors
    if stage == layout.last_rank:
        split, whole, tensors = split + pr["post"].split, whole + pr["post"].replicated, \
            tensors + pr["post"].tensors
        if profile.tied and layout.pp > 1:  # the head's own copy of the tied embedding
            split, tensors = split + profile.tied_elements, tensors + 1
    return split, whole, tensors


def layer_params(profile: ModelProfile, tp: int) -> tuple[int, int]:
    """(tp-split, replicated) parameter elements of one layer at tensor parallelism `tp`."""
    layer = profile.params["layer"]
    moved = layer.kv if profile.kv_divisor(tp) == 1 else 0
    return layer.split - moved, layer.replicated + moved


def stage_memory_terms(profile: ModelProfile, layout: Layout, stage: int, prec: Precision,
                       *, bb, ss, tt, dd, mn: Callable = min) -> dict[str, object]:
    """The memory terms of pipeline `stage` (see module docstring).

    `bb, ss, tt, dd` are b, s, t, d as numbers, or as sympy symbols (with
    `mn=sympy.Min`) to get the expression. Each part is remembered in the
    profile's memo under everything it depends on: plan search asks for the
    same parts thousands of times.
    """
    lay, zero = layout, layout.zero
    kv_whole = profile.kv_divisor(lay.tp) == 1  # replicated key/value heads: whole on a rank
    weights, grads, optimizer = _memo(
        profile, ("state", lay.pp, lay.layers, lay.chunk_layers, stage, lay.last_rank, prec, tt,
                  dd, zero, kv_whole, lay.offload, lay.ep),
        lambda: _model_state(profile, lay, stage, prec, tt, dd))
    mb = m if mn is sympy.Min else lay.microbatches
    activations, recompute = _memo(
        profile, ("act", lay.schedule, lay.pp, lay.vstages, lay.layers, lay.chunk_layers, mb,
                  stage,
                  lay.stage_policies(stage),
                  tuple(c and lay.policy(c[0]) for c in lay.chunks(stage)),
                  bb, ss, tt, lay.sp, kv_whole),
        lambda: _stage_activations(profile, lay, stage, bb, ss, tt, mb, mn))
    buffers = _memo(profile, ("buffers", lay.pp, lay.layers, lay.chunk_layers, stage,
                              lay.last_rank, lay.sp,
                              lay.grad_ranks > 1, zero >= 3, prec, bb, ss, tt, kv_whole),
                    lambda: _buffers(profile, lay, stage, prec, bb, ss, tt, mn))
    if zero >= 3 and lay.schedule in SPLIT_BACKWARD and lay.pp > 1:
        buffers += regathered_until_w(profile, lay, stage, prec, tt)
    return dict(weights=weights, grads=grads, optimizer=optimizer, activations=activations,
                recompute=recompute, buffers=buffers)


def regathered_until_w(profile: ModelProfile, layout: Layout, stage: int, prec: Precision,
                      tt) -> object:
    """ZeRO-3 under a split backward: the weights a micro-batch's I re-gathers stay gathered
    until its W (`ptc.runtime.executor`): one chunk's layers, and the head on the last
    stage, for each micro-batch between the two, as many at once as the schedule's
    simulation holds on this rank (the embedding has no input gradient: I leaves it)."""
    split, whole = layer_params(profile, layout.tp)
    post = profile.params["post"]
    per_chunk = [len(chunk) * (split / tt + whole) for chunk in layout.chunks(stage)]
    if stage == layout.last_rank:  # the head, and its own copy of a tied embedding
        tied = profile.tied_elements if profile.tied else 0
        per_chunk[-1] += (post.split + tied) / tt + post.replicated
    waiting = simulated(layout.schedule, layout.pp, layout.microbatches,
                        layout.vstages).peak_waiting_for_w[stage]
    return waiting * prec.weight * max(per_chunk)


def _memo(profile: ModelProfile, key: tuple, make: Callable):
    if key not in profile.memo:
        profile.memo[key] = make()
    return profile.memo[key]


def _model_state(profile: ModelProfile, layout: Layout, stage: int, prec: Precision, tt, dd
                 ) -> tuple:
    """(weights, grads, optimizer) bytes of one rank of `stage`.

    Under expert parallelism a rank holds whole only its 1/ep of the routed experts; what
    ZeRO shards is the same share as without it (1/ep of the experts over dp·cp/ep ranks)."""
    zero = layout.zero
    split, whole, tensors = stage_params(profile, layout, stage)
    n = split / tt + whole  # elements a dp rank's tp rank would hold whole
    held = n if layout.ep == 1 else \
        n - stage_experts(profile, layout, stage, tt) * (layout.ep - 1) / layout.ep
    weight, (grad, grad_shard), state = held_per_element(prec, zero)
    weights = weight * n / dd if zero >= 3 else weight * held
    grads = grad * held + grad_shard * n / dd
    counters = 4 * tensors if prec.optimizer else 0
    optimizer = 0 if layout.offload else \
        (state * n + counters) / dd if zero >= 1 else state * held + counters
    return weights, grads, optimizer


def stage_experts(profile: ModelProfile, layout: Layout, stage: int, tt) -> object:
    """Routed experts' elements one tp rank of `stage` would hold without expert parallelism
    (part of `stage_params`'s)."""
    layer = profile.params["layer"]
    return len(layout.stage_layers(stage)) * (layer.experts / tt + layer.experts_whole)


def offloaded_per_element(prec: Precision) -> int:
    """Host bytes per parameter element under optimizer offload, before ZeRO divides them by
    dp: the fp32 master, the optimizer's moments and the fp32 gradient the CPU step reads."""
    moments = prec.optimizer - (MASTER_BYTES if prec.weight < MASTER_BYTES else 0)
    return MASTER_BYTES + moments + MAIN_GRAD_BYTES


def stage_host_bytes(profile: ModelProfile, layout: Layout, stage: int, prec: Precision, *,
                     tt, dd) -> object:
    """Host memory one rank of pipeline `stage` needs for its optimizer: what offload moves
    off the device plus the host copies it steps from (0 without offload). Adam's 4-byte
    step counters go with the moments, as the device would count them."""
    if not layout.offload:
        return 0
    split, whole, tensors = stage_params(profile, layout, stage)
    counters = 4 * tensors if prec.optimizer else 0
    return (offloaded_per_element(prec) * (split / tt + whole) + counters) / dd


def held_per_element(prec: Precision, zero: int) -> tuple[int, tuple[int, int], int]:
    """(weight, (gradient, gradient shard), optimizer) bytes a rank holds per parameter
    element; weight and optimizer before ZeRO divides them by dp, the gradient as (bytes
    held whole, bytes held as a 1/dp shard).

    ZeRO-3 keeps one fp32 shard that is both the weight and the master (the graph casts
    what it gathers to the compute dtype, as FSDP2 does), so no separate 16-bit copy of the
    weights stays resident. Gradients: ZeRO 0-1 accumulate in a whole buffer of the gradient
    dtype, plus (a 16-bit one) the fp32 copy the optimizer steps from, whole at ZeRO-0 and
    of the rank's shard at ZeRO-1; ZeRO-2 and 3 keep only an fp32 shard (a micro-batch's
    16-bit gradients are reduce-scattered into it as they are made)."""
    weight, state = prec.weight, prec.optimizer
    if zero >= 3 and prec.weight < 4 and prec.optimizer >= 4:
        weight, state = 4, prec.optimizer - 4
    if zero == 0:
        grads = (prec.grad + prec.main_grad, 0)
    elif zero == 1:
        grads = (prec.grad, prec.main_grad)
    else:
        grads = (0, MAIN_GRAD_BYTES)
    return weight, grads, state


def _stage_activations(profile: ModelProfile, layout: Layout, stage: int, bb, ss, tt, mb,
                       mn: Callable) -> tuple:
    """(activations in flight, recompute working set) bytes of one rank of `stage`."""
    p = layout.pp
    mx = sympy.Max if mn is sympy.Min else max
    act = _saved_bytes(profile, layout, bb, ss, tt)

    units, per_unit = in_flight(layout, stage, mb, mn)
    pairs = layout.stage_policies(stage)
    policies = [pol for pol, _ in pairs]
    # Layers of one stage are alike; the mean per-layer footprint times the layers in flight.
    per_layer = sum(count * act("layer", pol) for pol, count in pairs) / sum(c for _, c in pairs)
    activations = units * per_unit * per_layer
    chunks = layout.chunks(stage)
    activations += (units * _chunk_ends(layout, stage, profile.holds_input)
                    * act("out_unsaved", "none") / len(chunks))
    if stage == 0 and not chunks[0]:  # a stage of the embedding alone holds its output
        activations += units * act("out", "none") / len(chunks)
    pre_units = _first_chunk_units(layout, units, mb, mn)
    if stage == 0:
        activations += pre_units * act("pre", "none")
    if stage == _first_layer_stage(layout) and layout.policy(0) in profile.holds_input:
        # Layer 0's checkpoint keeps what it reads: the embedding's output.
        activations += (pre_units if stage == 0 else units / len(chunks)) \
            * act("in_unsaved", "none")
    if stage == layout.last_rank:  # 1F1B's last stage runs each B right after its F;
        # GPipe's holds the loss of every micro-batch, zero bubble's of each until its W
        post_units = {"gpipe": units, "zero_bubble": mn(p, mb)}.get(layout.schedule, 1)
        if layout.schedule in V_SHAPED:  # as many as its order holds at once
            post_units = stage_peaks(layout.schedule, p, layout.microbatches, 2)[-1]
        activations += post_units * act("post", "none")
    if layout.schedule in SPLIT_BACKWARD and p > 1:
        activations += rebuilt_until_w(profile, layout, stage, bb, ss, tt)
    recompute = 0
    if "full" in policies:
        recompute = act("layer", "none")
    elif "selective" in policies and len(set(policies) - {"none"}) == 1:
        recompute = act("layer", "none") - act("layer", "selective")
    elif set(policies) - {"none"}:  # what the most freeing policy rebuilds
        freed = [act("layer", "none") - act("layer", pol)
                 for pol in sorted(set(policies) - {"none"})]
        recompute = freed[0] if len(freed) == 1 else mx(*freed)
    if stage == layout.last_rank:  # the loss's backward, before any layer's: not together
        recompute = mx(recompute, _loss_gradients(profile, bb, ss, tt))
    return activations, recompute


LOSS_GRADIENT_BYTES = 2 * 4
"""Bytes per token and vocabulary entry the loss's backward holds beyond what is saved: two
float32 gradients of the logits at once (of the log-softmax and of its input; the
vocabulary-parallel loss's softmax copy and its scaled gradient), whatever the compute dtype
(ptc's loss runs on the logits' float32 copy, `ptc.compiler.capture.normalise`)."""


def _loss_gradients(profile: ModelProfile, bb, ss, tt) -> object:
    """Bytes the loss's backward holds at once on one rank for one micro-batch of `bb`
    samples of `ss` positions: `LOSS_GRADIENT_BYTES` per token and vocabulary entry of the
    rank (V/t where tensor parallelism splits the head over the vocabulary, its own weight
    or the embedding table it is tied to)."""
    head = profile.params["post"].split or (profile.tied and profile.params["pre"].split)
    return LOSS_GRADIENT_BYTES * bb * ss * profile.vocab / (tt if head else 1)


def _saved_bytes(profile: ModelProfile, layout: Layout, bb, ss, tt
                 ) -> Callable[[str, str], object]:
    """act(region, policy): the saved bytes of one region for one micro-batch on one rank
    of `layout` (`_activation` with the layout's sequence and key/value divisors)."""
    f = saved_functions(profile, layout.sp)
    seq_div = tt if layout.sp else 1
    kv_div = tt if profile.kv_divisor(layout.tp) == layout.tp else 1

    def act(region: str, policy: str) -> object:
        return _activation(f, region, policy, bb, ss, tt, seq_div, kv_div,
                           policy in profile.holds_input)
    return act


def rebuilt_until_w(profile: ModelProfile, layout: Layout, stage: int, bb, ss, tt) -> object:
    """A split backward's recomputed layers (`ptc.ops.recompute.recompute_once`): I rebuilds
    a checkpointed region once, and what the weight gradients read of it stays until W. A
    bound, charged per micro-batch between I and W (the schedule's simulation, the first
    stage's I doing nothing): all the region rebuilds, `none` less the policy's own, for
    one chunk's layers. What stays is the inputs of the ops with weights, measured at 43 %
    of the bound on the tiny Llama and 53 % on the tiny GPT
    (`tests/distributed/test_pp_equivalence.py`); the selective policy's region, the
    attention core, holds no weight and keeps nothing."""
    act, pairs = _saved_bytes(profile, layout, bb, ss, tt), layout.stage_policies(stage)
    rebuilt = sum(count * (act("layer", "none") - act("layer", policy))
                  for policy, count in pairs if policy not in ("none", "selective"))
    if not rebuilt:
        return 0
    per_layer = rebuilt / sum(count for _, count in pairs)
    waiting = simulated(layout.schedule, layout.pp, layout.microbatches,
                        layout.vstages).peak_waiting_for_w[stage]
    return waiting * max(len(chunk) for chunk in layout.chunks(stage)) * per_layer


def saved_functions(profile: ModelProfile, sp: bool) -> Mapping[str, Callable]:
    """The profile's functions with its saved-bytes terms as measured under sequence
    parallelism (`ModelProfile.sp_saved`) in place of the plain ones when `sp` says so and
    it runs something whole; else the profile's own."""
    if not (sp and profile.sp_saved):
        return profile.fn
    return _Preferring(profile.fn, "sp:")


class _Preferring(Mapping):
    """`functions` read through: "prefix" + name where there is one, else name."""

    def __init__(self, functions: Mapping[str, Callable], prefix: str):
        self._functions, self._prefix = functions, prefix

    def __getitem__(self, name: str) -> Callable:
        preferred = self._prefix + name
        return self._functions[preferred if preferred in self._functions else name]

    def __iter__(self) -> Iterator[str]:
        return (name for name in self._functions if not name.startswith(self._prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _first_chunk_units(layout: Layout, units, mb, mn: Callable):
    """Micro-batches in flight in the first rank's first chunk, whose embedding output it
    keeps: all its units with one chunk; interleaved holds p there, zero bubble 2p (its Ws
    of the first chunk wait for the end of the step; `ptc.compiler.schedule.build`); under
    ZB-V and DualPipeV, whose orders are not one formula, what their simulation holds on
    stage 0."""
    if layout.vstages == 1:
        return units
    if layout.schedule in V_SHAPED:  # as many as its order holds at once
        return stage_peaks(layout.schedule, layout.pp, layout.microbatches, 2)[0]
    return mn((2 if layout.schedule == "zero_bubble" else 1) * layout.pp, mb)


def _first_layer_stage(layout: Layout) -> int:
    """The pipeline rank that runs layer 0: the first, or the second where the first
    stage holds the embedding alone (`ParallelSpec.stage_layers`)."""
    return 0 if layout.chunks(0)[0] else 1 % layout.pp


def _chunk_ends(layout: Layout, stage: int, holds_input=frozenset({"full"})) -> int:
    """How many unsaved layer outputs (`ModelProfile.output_unsaved`) the per-layer sums of
    `stage`'s chunks miss (positive) or count too often (negative), over all its chunks.

    What keeps the tensor between two layers follows the layer that reads it:
    its checkpoint, whole, when that layer is fully recomputed, else whatever
    of it a node saves. The per-layer sums charge it by the layer that makes
    it (`ModelProfile.layer_output` for a full one). Along a chunk these are
    the same charges shifted by one layer, so they differ only at its ends:
    the chunk's output, which the pipeline runtime holds until the
    micro-batch's backward (after the model's last layer only what the nodes
    there save counts), adds one; a first layer whose checkpoint keeps its
    input (`holds_input`: "full", and policies whose regions read it), charged
    for its output by its own policy rather than by its reader's, takes one off.
    """
    ends = 0
    for layers in layout.chunks(stage):
        if layers:  # a stage of no layer (the embedding or the loss alone) is charged apart
            ends += (layers[-1] != layout.layers - 1) - (layout.policy(layers[0]) in holds_input)
    return ends


def _buffers(profile: ModelProfile, layout: Layout, stage: int, prec: Precision, bb, ss, tt,
             mn: Callable = min) -> object:
    """Communication buffers and runtime reserve of one rank of `stage`: the gradient
    reduction's two buckets in flight, each a copy of its units' gradients, hold at most
    the stage's gradients (a stage smaller than two buckets has no more in flight,
    `ptc.runtime.grads`)."""
    boundary = prec.weight * profile.fn["boundary"](bb, ss)
    buffers = prec.reserve
    if layout.pp > 1:
        buffers += 2 * boundary / (tt if layout.sp else 1)
    if layout.sp:
        buffers += boundary
    if layout.grad_ranks > 1:
        split, whole, _ = stage_params(profile, layout, stage)
        buffers += mn(2 * GRAD_BUCKET_ELEMENTS, split / tt + whole) * prec.grad
    if layout.zero >= 3:
        split, whole = layer_params(profile, layout.tp)
        buffers += 2 * prec.weight * (split / tt + whole)
    return buffers


def _activation(f: dict[str, Callable], region: str, policy: str, bb, ss, tt, seq_div,
                kv_div=None, holds: bool = False) -> object:
    """Saved bytes of one region for one micro-batch on one rank, under a recompute policy;
    `kv_div` divides the key/value path's part of the tp class (tt unless replicated).

    A layer under a policy beyond none / selective / full has its own terms
    (`ModelProfile.policy_saved`); `holds`: its checkpoint keeps the layer's input, so, as
    "full" does with its `layer_output`, it is charged the part of its output no node saves
    (`_chunk_ends`).
    """
    if policy == "full":
        region = "out"
    elif region == "layer" and policy not in ("none", "selective"):
        if f"{policy}.tp" not in f:
            raise KeyError(policy)
        region = policy
        if holds:
            return _activation(f, policy, "none", bb, ss, tt, seq_div, kv_div) \
                + _activation(f, "out_unsaved", "none", bb, ss, tt, seq_div, kv_div)
        policy = "none"
    kv_div = tt if kv_div is None else kv_div

    def split(tp: str, kv: str) -> object:
        kv_bytes = f[f"{region}.{kv}"](bb, ss)
        return (f[f"{region}.{tp}"](bb, ss) - kv_bytes) / tt + kv_bytes / kv_div

    whole = f[f"{region}.whole"](bb, ss)  # the part of seq sequence parallelism leaves whole
    split_const = f[f"{region}.split_const"](bb, ss)  # rowwise column scales of a tp shard
    full = split("tp", "kv") + (f[f"{region}.seq"](bb, ss) - whole) / seq_div + whole \
        + f[f"{region}.const"](bb, ss) - split_const + split_const / tt
    if policy != "selective":
        return full
    core_whole = f[f"{region}.core_whole"](bb, ss)
    return full - (split("core_tp", "core_kv")
                   + (f[f"{region}.core_seq"](bb, ss) - core_whole) / seq_div + core_whole
                   + f[f"{region}.core_const"](bb, ss))


def check_policies(profile: ModelProfile, policies) -> None:
    """Raise the CompileError of the first policy the model's layers cannot take."""
    for policy in policies:
        if policy in profile.unavailable:
            raise CompileError(profile.unavailable[policy])


def stage_memory(profile: ModelProfile, layout: Layout, prec: Precision, seq_len: int
                 ) -> list[dict[str, float]]:
    """Memory terms of every pipeline stage, in bytes."""
    return [{k: float(v) for k, v in stage_memory_terms(
        profile, layout, i, prec, bb=layout.micro_batch, ss=layout.rank_seq(seq_len),
        tt=layout.tp, dd=layout.grad_ranks).items()} for i in range(layout.pp)]


def stage_host_memory(profile: ModelProfile, layout: Layout, prec: Precision) -> list[float]:
    """Host bytes one rank of each pipeline stage needs (`stage_host_bytes`)."""
    return [float(stage_host_bytes(profile, layout, i, prec, tt=layout.tp, dd=layout.grad_ranks))
            for i in range(layout.pp)]


def stage_memory_expr(profile: ModelProfile, layout: Layout, prec: Precision, stage: int
                      ) -> dict[str, sympy.Expr]:
    """Memory terms of `stage` as sympy expressions in b, s, t, d, m."""
    terms = stage_memory_terms(profile, layout, stage, prec, bb=b, ss=s, tt=t, dd=d, mn=sympy.Min)
    return {k: sympy.sympify(v) for k, v in terms.items()}


def layer_activations(profile: ModelProfile, policy: str, *, sp: bool) -> sympy.Expr:
    """Saved bytes of one layer for one micro-batch on one tp rank, in b, s, t."""
    return sympy.expand(_activation(profile.fn, "layer", policy, b, s, t, t if sp else 1,
                                    holds=policy in profile.holds_input))


def layer_activation_bytes(profile: ModelProfile, policy: str, *, micro_batch: int, seq_len: int,
                           tp: int, sp: bool) -> float:
    """Saved bytes of one layer for one micro-batch on one tp rank under `policy`, a number."""
    return float(_activation(profile.fn, "layer", policy, micro_batch, seq_len, tp,
                             tp if sp else 1, profile.kv_divisor(tp),
                             holds=policy in profile.holds_input))


def peak(terms: dict[str, float]) -> float:
    """Peak bytes of one stage: the sum of its terms."""
    return sum(terms.values())
