"""Step time: compute + exposed communication + pipeline bubble + optimizer step.

Terms: F is a layer's forward FLOPs for one micro-batch (from the graph), T_i
the time stage i spends on one micro-batch (its layers' forward, backward,
recompute, and the communication it cannot hide).

- compute: each layer's forward and backward priced op by op from the work
  its captured graph asks for (`ptc.compiler.cost.compute`: GEMMs at the GEMM
  rate, float8 ones at the fp8 rate, memory-bound ops by the bytes they move
  at the memory bandwidth, the host's dispatch of each op), per rank as
  tensor, sequence and context parallelism divide it; recompute adds the
  layer's forward (full), its attention core's forward (selective), or the
  forward of the ops another policy's regions rerun.
- tensor parallel: two all-reduces of b·s·h elements per layer forward, two
  backward, two more in a full (or `ops`) recompute; with sequence parallelism
  each is a reduce-scatter plus an all-gather of the same size, a module
  region that recomputes a norm's output reruns the all-gather before the
  linears reading it (`rerun_gathers`), and backward gathers each entry's
  input again where no region recomputes it, for the column-parallel
  linears' weight gradients (`regathers`: the runtime keeps only the rank's
  chunk of it, as Megatron-LM does). What of them the runtime hides, behind
  which GEMMs, is `ptc.compiler.cost.tp_exposure`'s: the backward's
  input-gradient reductions and re-gathers beside the column-parallel
  linears' gradients; with `tp_comm = async` (collective matmuls) every
  sequence-parallel collective beside the GEMMs it feeds; the rest exposed.
  Key/value heads fewer than t are replicated: their projections' FLOPs are
  not divided by t, and their gradients are all-reduced over tp once a step.
- expert parallel: per layer with routed experts, four all-to-alls of its
  routed rows (b·s·k rows of h: dispatch and combine forward, their
  gradients backward; two more where a recompute reruns the layer), each
  rank sending (ep-1)/ep of them, exposed (the runtime waits for each). A
  rank holds, reduces and updates 1/ep of the experts
  (`ptc.compiler.memory.model`). The routing's imbalance u (`moe.imbalance`:
  the rows the busiest ep rank receives over the mean, 1 for an even
  routing) makes every rank wait for the busiest: its all-to-alls carry u
  times the mean's rows, and its experts' GEMMs (forward and backward) take
  u times the mean's time, the (u - 1) more counted in compute
  (`expert_wait`).
- pipeline: one boundary activation forward and one gradient backward per
  micro-batch per chunk, 1/t of it per rank (scatter/gather, or SP). With
  overlap only the fill and drain hops are exposed; without, every one is.
  Step = m · max_i T_i + (p - 1)/v · mean_i T_i; the second part is the bubble.
- data parallel: ZeRO-0 all-reduces the gradients; ZeRO-1/2 reduce-scatter
  them and all-gather the updated weights; with overlap these hide behind
  the last micro-batch's backward and the next forward (the stage's forward
  and backward seconds as priced op by op). ZeRO-3 gathers each
  layer's weights for every forward (the recompute forward included) and
  again for backward, and reduce-scatters its gradients, every micro-batch;
  with overlap each layer's traffic hides behind that layer's compute.
- contention: a collective hidden behind compute holds some of the GPU's SMs
  while it runs (NCCL's thread blocks), so the compute beside it runs on the
  rest: each second of tp, pp or dp communication hidden adds
  `HardwareSpec.contention` (comm_multiprocessors / multiprocessors) of a
  second. Optimizer offload's copies run on the copy engines and add none.
- step sync: the guard's all-reduce (which carries the gradient norm), and the latency of
  gathering ZeRO 1-2's weights unit by unit (`ptc.compiler.cost.step_sync`).
- on a CPU (`HardwareSpec.synchronous`) collectives run on the cores that
  compute: nothing overlaps, whatever `overlap` says.
- optimizer: memory-bound; it reads gradient and state and writes state and
  weight once per parameter shard, at the device memory bandwidth. With
  optimizer offload (`offloaded_step`) instead: per unit (the embedding,
  each layer, the head), its fp32 gradient shard down over the host link,
  torch's CPU Adam on it (the node's ranks share the host's CPU), its
  weights up (fp32 at ZeRO-3, the compute dtype at ZeRO 1-2), pipelined as
  the runtime runs them: three resources in a row, the units in order
  (a flow shop). What the step waits for is exposed; the rest of the
  copies is hidden (`StepCost.hidden`). At ZeRO-3 the weights still on
  their way when the CPU is done hide behind the next forward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ptc.compiler.cost import collectives as comm
from ptc.compiler.cost.compute import LayerTimes, Split, layer_times, rates
from ptc.compiler.records.layout import Layout
from ptc.compiler.memory.model import (MAIN_GRAD_BYTES, MASTER_BYTES, Precision, layer_params,
                                       stage_experts, stage_params)
from ptc.compiler.profile.types import ModelProfile
from ptc.compiler.cost.step_sync import step_sync
from ptc.compiler.cost.topology import AxisGroup, axis_placements
from ptc.compiler.cost.tp_exposure import BoundaryCollectives, layer_tp_time, linear_times
from ptc.plan import SPLIT_BACKWARD, HardwareSpec, policy_modules


CPU_ADAM_ELEMENTS_PER_S = 0.72e9
"""Parameter elements per second torch's Adam steps on a GPU server's host CPU: ZeRO-Offload
(Ren et al., USENIX ATC 2021), Table 2, PyTorch's CPU Adam 1.39 s per billion parameters
on a DGX-2's two 24-core Xeons (its vectorised CPU-Adam: 0.22 s). One host, all its cores."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepCost:
    """Predicted time of one optimizer step and where it goes."""

    step_time: float
    """Seconds per step."""
    breakdown: dict[str, float]
    """Seconds by part: compute, recompute, tp_comm, pp_comm, dp_comm, bubble, optimizer,
    step_sync."""
    model_flops: float
    """FLOPs of one step without recompute (forward + backward = 3x forward), all GPUs."""
    hw_flops: float
    """FLOPs of one step including recomputed forwards, all GPUs."""
    algorithms: dict[str, str] = field(default_factory=dict)
    """Collective algorithm per traffic kind ("tp", "dp", ...)."""
    hidden: dict[str, float] = field(default_factory=dict)
    """Seconds of work that runs under other work, by the part it would add to: not in
    `step_time` ("optimizer": optimizer offload's copies under the CPU step or the next
    forward)."""


@dataclass(frozen=True, slots=True)
class OffloadTime:
    """One offloaded optimizer step (`offloaded_step`)."""

    exposed: float
    """Seconds the step waits for: from the first gradient copy until the weights' first
    reader may go on."""
    hidden: float
    """Seconds of copies that run while the CPU steps or the next forward computes."""


@dataclass(slots=True)
class _Stage:
    compute: float = 0.0
    forward: float = 0.0
    """The forward part of `compute`."""
    weight_grad: float = 0.0
    """The weight-gradient part of `compute` (a split backward's W)."""
    recompute: float = 0.0
    tp: float = 0.0
    tp_hidden: float = 0.0
    """Tensor-parallel communication that ran beside compute (not in `total`)."""
    cp: float = 0.0
    ep: float = 0.0
    """Expert parallelism's all-to-alls (the runtime waits for each)."""
    pp: float = 0.0
    dp: float = 0.0
    dp_hidden: float = 0.0
    """ZeRO-3's gathers and reduce-scatters that ran beside compute (not in `total`)."""

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.tp + self.cp + self.ep + self.pp + self.dp


def _tp_collectives(size: float, layout: Layout, group: AxisGroup, hw: HardwareSpec,
                    count: int) -> tuple[float, str]:
    """Seconds of `count` TP all-reduces of `size` bytes (RS + AG pairs with SP)."""
    if layout.sp:
        rs, ag = comm.reduce_scatter(size, group, hw), comm.all_gather(size, group, hw)
        return count * (rs.seconds + ag.seconds), f"rs+ag:{rs.algorithm}"
    ar = comm.all_reduce(size, group, hw)
    return count * ar.seconds, ar.algorithm


def _cached(memo: dict | None, key: tuple, make):
    """`make()`, remembered under `key` in `memo` when one is given."""
    if memo is None:
        return make()
    if key not in memo:
        memo[key] = make()
    return memo[key]


def step_cost(profile: ModelProfile, layout: Layout, hw: HardwareSpec, prec: Precision,
              *, seq_len: int, dtype: str, memo: dict | None = None,
              imbalance: float = 1.0) -> StepCost:
    """Predict one optimizer step of `layout` (see module docstring).

    `memo`: a dict to share collective and FLOP figures between calls for the
    same plan (plan search prices thousands of layouts that repeat them).
    `imbalance`: the routing's, `moe.imbalance` (1: even).
    """
    if hw.synchronous and layout.overlap:
        # A CPU's collectives run on the cores that compute: nothing hides behind anything.
        layout = dataclasses.replace(layout, overlap=False)
    f, tp, p, v, mb = profile.fn, layout.tp, layout.pp, layout.vstages, layout.microbatches
    cp = layout.cp
    bb, ss = layout.micro_batch, layout.rank_seq(seq_len)  # the positions a rank holds
    groups = _cached(memo, ("groups", tp, cp, p, layout.dp, layout.order),
                     lambda: axis_placements({"tp": tp, "cp": cp, "pp": p, "dp": layout.dp},
                                         layout.order, hw.gpus_per_node))
    algos: dict[str, str] = {}

    kv_div = profile.kv_divisor(tp)  # 1: fewer key/value heads than tp, computed whole
    # Under cp a rank's queries (s/cp of them) meet all s keys: its attention core is 1/cp of
    # the whole sequence's, not that of a sequence of s/cp.
    keys = _cached(memo, ("keys", bb, seq_len, cp), lambda: (
        f["core_flops"](bb, seq_len) / cp - f["core_flops"](bb, ss)))
    layer_f, core_f, boundary, pre_f, post_f, fp8_f = _cached(
        memo, ("flops", bb, ss, tp, cp), lambda: (
            (f["flops.layer"](bb, ss) + keys - f["kv_flops"](bb, ss)) / tp
            + f["kv_flops"](bb, ss) / kv_div,
            (f["core_flops"](bb, ss) + keys) / tp, prec.weight * f["boundary"](bb, ss),
            f["flops.pre"](bb, ss) / tp, f["flops.post"](bb, ss) / tp,
            f["fp8_flops"](bb, ss) / tp))
    # Seconds of a layer's forward and backward, op by op (`ptc.compiler.cost.compute`).
    times = _cached(memo, ("times", bb, ss, tp, cp, layout.sp, layout.fused), lambda: layer_times(
        profile, rates(hw, dtype), bb=bb, ss=ss, seq_len=seq_len,
        split=Split(tp=tp, kv_divisor=kv_div, sp=layout.sp, cp=cp), fused=layout.fused))

    # Per-layer communication, by recompute policy, and how much of it the runtime hides.
    tp_unit, algos["tp"] = _cached(memo, ("tp", bb, ss, tp, layout.sp, groups["tp"]),
                                   lambda: _tp_collectives(boundary, layout, groups["tp"], hw, 1))
    policies = {pol for i in range(p) for pol, _ in layout.stage_policies(i)}
    each = _cached(memo, ("tp_each", bb, ss, tp, groups["tp"]), lambda: BoundaryCollectives(
        all_gather=comm.all_gather(boundary, groups["tp"], hw).seconds,
        reduce_scatter=comm.reduce_scatter(boundary, groups["tp"], hw).seconds,
        all_reduce=comm.all_reduce(boundary, groups["tp"], hw).seconds))
    whole = 0.0
    if layout.sp and tp > 1:  # what sequence parallelism runs whole: its gathers
        whole = (comm.all_gather(f["sp_gathered"](bb, ss), groups["tp"], hw).seconds,
                 comm.all_gather(f["sp_scattered"](bb, ss), groups["tp"], hw).seconds)
    linears = linear_times(profile, rates(hw, dtype), bb=bb, ss=ss, split=Split(
        tp=tp, kv_divisor=kv_div, sp=layout.sp, cp=cp), weight_grad=times.weight_grad)
    tp_layer = {pol: layer_tp_time(
        profile, tp=tp, sp=layout.sp, async_tp=layout.tp_comm == "async",
        overlap=layout.overlap, rerun_layer=pol in RERUN_LAYER,
        regathers=regathers(profile, pol, layout.sp), each=each, linears=linears,
        exposed_extra=rerun_gathers(profile, pol, layout.sp) * each.all_gather + (
            (2 if pol in RERUN_LAYER else 1) * whole[0] + whole[1] if whole else 0.0))
        for pol in policies}
    z3 = {}
    if layout.zero >= 3:
        split, whole = layer_params(profile, tp)
        layer_bytes = prec.weight * (split / tp + whole)
        ag, rs = _cached(memo, ("z3", tp, groups["grad"]), lambda: (
            comm.all_gather(layer_bytes, groups["grad"], hw),
            comm.reduce_scatter(layer_bytes / prec.weight * prec.grad, groups["grad"], hw)))
        algos["dp"] = f"ag:{ag.algorithm} rs:{rs.algorithm}"
        for policy in policies:
            z3[policy] = (3 if policy in RERUN_LAYER else 2) * ag.seconds + rs.seconds

    # Keys and values all-gathered over cp at each attention, one collective each (and again
    # when a full layer is recomputed), their gradients reduce-scattered: exposed, as Llama
    # 3's all-gather runs before the attention it feeds.
    k_bytes = prec.weight * bb * seq_len * profile.hidden * profile.kv_heads / profile.heads
    cp_gather, cp_scatter = _cached(memo, ("cp", k_bytes, tp, kv_div, groups["cp"]), lambda: (
        (2 * comm.all_gather(k_bytes / kv_div, groups["cp"], hw).seconds,
         2 * comm.reduce_scatter(k_bytes / kv_div, groups["cp"], hw).seconds)
        if cp > 1 else (0.0, 0.0)))
    cp_layer = {pol: (2 if pol in RERUN_LAYER else 1) * cp_gather + cp_scatter
                for pol in policies}
    ep_unit = _cached(memo, ("ep", bb, ss, layout.ep, groups["grad"]), lambda: comm.all_to_all(
        ep_rows_bytes(profile, prec, bb, ss), expert_group(groups["grad"], layout.ep),
        hw).seconds)
    ep_layer = {pol: ep_exchanges(pol) * ep_unit * (imbalance if layout.ep > 1 else 1.0)
                for pol in policies}
    rate = rates(hw, dtype)
    waits = expert_wait(profile, layout, rate.fp8 or rate.gemm, bb, ss, imbalance)
    extra_f = {pol: _recompute_flops(f, pol, bb, ss, keys, layer_f, core_f, tp)
               for pol in policies}
    p2p = _cached(memo, ("p2p", boundary, tp, groups["pp"]),
                  lambda: comm.send_recv(boundary / tp, groups["pp"], hw))
    tp_edge = tp_unit if tp > 1 else 0.0

    def stage(first: bool, last: bool, policies: tuple[tuple[str, int], ...]) -> _Stage:
        st = _Stage()
        for policy, count in policies:
            work = times.forward + times.backward
            extra = times.recompute[policy]
            st.compute += count * (work + waits)
            st.forward += count * times.forward
            st.weight_grad += count * times.weight_grad
            st.recompute += count * extra
            hide = work + extra if layout.overlap else 0.0
            st.tp += count * tp_layer[policy].exposed
            st.tp_hidden += count * tp_layer[policy].hidden
            st.cp += count * cp_layer[policy]
            st.ep += count * ep_layer[policy]
            if z3:
                exposed = max(0.0, z3[policy] - hide)
                st.dp += count * exposed
                st.dp_hidden += count * (z3[policy] - exposed)
        if first:
            st.compute += times.pre
            st.forward += times.pre_forward
        if last:
            st.compute += times.post
            st.forward += times.post_forward
            st.weight_grad += times.post_weight_grad
        if first or last:  # vocab-parallel embedding forward, head input backward
            st.tp += tp_edge
        if not layout.overlap:
            st.pp += 2 * v * p2p.seconds
        return st

    # Stages differ only in being first or last and in their policy mix: price each kind once.
    kinds: dict[tuple, list] = {}
    for i in range(p):
        key = (i == 0, i == layout.last_rank, layout.stage_policies(i))
        if key not in kinds:
            kinds[key] = [stage(*key), 0]
        kinds[key][1] += 1
    slowest = max((st for st, _ in kinds.values()), key=lambda x: x.total)
    mean = sum(st.total * n for st, n in kinds.values()) / p
    # A split backward (zero bubble, ZB-V) fills the bubble with its Ws: it leaves
    # (p - 1)/v · (F + I - W) of each stage's time (Qi et al., 2024).
    bubble = (p - 1) / v * (mean if layout.schedule not in SPLIT_BACKWARD else mean - 2 * sum(
        st.weight_grad * n for st, n in kinds.values()) / p)
    fill = 2 * (p - 1) * p2p.seconds if layout.overlap else 0.0
    dp_exposed, dp_issued = _dp_exposed(profile, layout, groups["grad"], hw, prec, slowest,
                                        algos, memo) if layout.zero < 3 else (0.0, 0.0)
    opt_elements = _max_stage_elements(profile, layout) / layout.grad_ranks \
        if layout.zero >= 1 else _max_stage_elements(profile, layout, held=True)
    # Communication that ran beside compute, by kind: issued = exposed (in the step) + hidden.
    pp_issued = mb * 2 * v * p2p.seconds if p > 1 else 0.0
    hidden = {part: seconds for part, seconds in (
        ("tp_comm", mb * slowest.tp_hidden),
        ("pp_comm", max(0.0, pp_issued - mb * slowest.pp - fill)),
        ("dp_comm", mb * slowest.dp_hidden + dp_issued - dp_exposed)) if seconds > 0}
    # The compute those collectives ran beside had the SMs their kernels did not hold.
    contention = hw.contention * sum(hidden.values())
    if layout.offload:
        # Every stage steps at once: the step waits for the slowest one's.
        offload = max((offloaded_step(
            [g / layout.grad_ranks for g in _stage_units(profile, layout, i)], hw,
            weight_bytes=MASTER_BYTES if layout.zero >= 3 else prec.weight,
            behind=slowest.forward if layout.zero >= 3 else 0.0)
            for i in range(p)), key=lambda t: t.exposed)
        optimizer, hidden["optimizer"] = offload.exposed, offload.hidden
    else:
        optimizer = opt_elements * (2 * prec.optimizer + prec.grad + prec.weight) \
            / hw.mem_bandwidth
    # Replicated key/value projections: their partial gradients summed over tp once a step.
    kv_sync = comm.all_reduce(prec.grad * profile.params["layer"].kv * _most_layers(layout),
                              groups["tp"], hw).seconds if kv_div == 1 and tp > 1 else 0.0

    breakdown = {
        "compute": mb * slowest.compute,
        "recompute": mb * slowest.recompute,
        "tp_comm": mb * slowest.tp + kv_sync,
        "cp_comm": mb * slowest.cp,
        "ep_comm": mb * slowest.ep,
        "pp_comm": mb * slowest.pp + fill,
        "dp_comm": mb * slowest.dp + dp_exposed,
        "bubble": bubble,
        "contention": contention,
        "optimizer": optimizer,
        "step_sync": _cached(memo, ("sync", tp, cp, p, layout.dp, layout.zero), lambda: step_sync(
            profile, layout, hw, prec, groups)),
    }
    per_micro = 3 * (layout.layers * f["flops.layer"](bb, seq_len)  # a whole sample's
                     + f["flops.pre"](bb, seq_len) + f["flops.post"](bb, seq_len))
    executed = 3 * tp * cp * (layout.layers * layer_f + pre_f + post_f)  # replicated work too
    recomputed = sum(tp * cp * extra_f[pol] * n for pol, n in layout.policy_counts())
    micro_total = mb * layout.dp
    return StepCost(step_time=sum(breakdown.values()), breakdown=breakdown,
                    model_flops=per_micro * micro_total,
                    hw_flops=(executed + recomputed) * micro_total, algorithms=algos,
                    hidden=hidden)


def ep_rows_bytes(profile: ModelProfile, prec: Precision, bb, ss) -> float:
    """Bytes one layer's routed rows take on a rank (b·s tokens, top-k rows each, `hidden`
    wide): what each of expert parallelism's all-to-alls is handed."""
    return prec.weight * bb * ss * profile.routed_rows * profile.hidden


def ep_bytes_per_step(profile: ModelProfile, layout: Layout, prec: Precision,
                      seq_len: int) -> float:
    """Bytes one rank hands expert parallelism's all-to-alls in one step, on the pipeline
    rank holding most layers: every layer's exchanges (`ep_exchanges`) of its routed rows
    (`ep_rows_bytes`), per micro-batch. What `ptc.ops.comm.record_collectives` counts."""
    if layout.ep == 1 or not profile.routed_rows:
        return 0.0
    rows = ep_rows_bytes(profile, prec, layout.micro_batch, layout.rank_seq(seq_len))
    return max(sum(ep_exchanges(pol) * n for pol, n in layout.stage_policies(stage))
               for stage in range(layout.pp)) * rows * layout.microbatches


def expert_wait(profile: ModelProfile, layout: Layout, gemm_rate: float, bb, ss,
                imbalance: float) -> float:
    """Seconds one layer's experts keep the ep group waiting per micro-batch: the busiest
    rank's experts compute `imbalance` times the mean's rows, forward and backward (three
    GEMMs of 2 FLOPs per weight element a row meets: one expert's elements, at
    `gemm_rate`: float8's where the experts run in it), the others wait for it at the next
    all-to-all. 0 without expert parallelism or at an even routing."""
    if layout.ep == 1 or imbalance <= 1.0 or not profile.routed_rows:
        return 0.0
    params = profile.params["layer"]
    per_expert = (params.experts / layout.tp + params.experts_whole) / profile.routed_experts
    mean_flops = 3 * 2 * bb * ss * profile.routed_rows * per_expert
    return (imbalance - 1.0) * mean_flops / gemm_rate


def ep_exchanges(policy: str) -> int:
    """All-to-alls of one layer's routed rows per micro-batch: dispatch and combine forward,
    their gradients backward, and the forward's again where the layer is recomputed."""
    return 6 if policy in RERUN_LAYER else 4


def expert_group(grad: AxisGroup, ep: int) -> AxisGroup:
    """Placement of an ep group: `ep` consecutive members of the dp·cp group `grad`."""
    return AxisGroup(axis="ep", size=ep, stride=grad.stride, per_node=min(ep, grad.per_node))


def policy_flops(profile: ModelProfile, policy: str, bb, ss) -> float:
    """Forward FLOPs one layer recomputes under `policy` per micro-batch, unsharded."""
    f = profile.fn
    if policy in ("none", "selective", "full"):
        return {"none": 0.0, "selective": f["core_flops"](bb, ss),
                "full": f["flops.layer"](bb, ss)}[policy]
    return f[f"flops.{policy}"](bb, ss)


RERUN_LAYER = frozenset({"full", "ops"})
"""Policies whose recompute reruns the whole layer's ops, its collectives among them."""


def rerun_gathers(profile: ModelProfile, policy: str, sp: bool) -> int:
    """Sequence all-gathers (of one b·s·h boundary each) that recomputing one layer under
    `policy` reruns beyond those of RERUN_LAYER's whole forward: with sequence parallelism,
    one per input of column-parallel linears its regions recompute (`norm`: each norm's
    output is gathered again before the linears reading it); none without."""
    if not sp or policy in RERUN_LAYER:
        return 0
    return profile.policy_gathers.get(policy, 0)


def regathers(profile: ModelProfile, policy: str, sp: bool) -> float:
    """Sequence all-gathers (of one b·s·h boundary each) one layer's backward runs again to
    read what its forward saved: with sequence parallelism the runtime keeps the rank's chunk
    of each entry's gathered input and gathers it again for the column-parallel linears'
    weight gradients (`ptc.ops.seq_regather`), except where a checkpoint region holds the
    entry (its recompute reruns the gather instead: RERUN_LAYER, `rerun_gathers`)."""
    if not sp or policy in RERUN_LAYER:
        return 0
    return max(0, profile.tp_entries - rerun_gathers(profile, policy, sp))


def _recompute_flops(f: dict, policy: str, bb, ss, keys, layer_f, core_f, tp) -> float:
    """Forward FLOPs one rank recomputes for a layer under `policy` (`layer_f`, `core_f`:
    the layer's and its attention core's on a rank; `keys`: the core's extra FLOPs under
    cp): the profile's FLOPs of exactly the ops the policy's regions rerun."""
    if policy == "none":
        return 0.0
    if policy == "full":
        return layer_f
    if policy == "selective":
        return core_f
    modules = policy_modules(policy) or frozenset()
    return f[f"flops.{policy}"](bb, ss) / tp + (keys / tp if "core_attn" in modules else 0.0)


def offloaded_step(units: list[float], hw: HardwareSpec, *, weight_bytes: float,
                   behind: float = 0.0) -> OffloadTime:
    """One offloaded optimizer step of a rank whose units hold `units` elements each (its
    shards, in the order the runtime steps them), as `ptc.runtime.offload` runs it.

    Three resources in a row, each unit through all three in order: the
    down copy of its fp32 gradient (MAIN_GRAD_BYTES an element over the
    rank's host link, `hardware.host_bandwidth` per direction), the CPU
    step (the host's CPU steps all `gpus_per_node` ranks' shards at once at
    `CPU_ADAM_ELEMENTS_PER_S`), the up copy of its weights (`weight_bytes`
    an element). Unit k finishes on resource r at

        C_r(k) = max(C_r(k-1), C_(r-1)(k)) + t_r(k)

    (C_0 = 0; the down copies are all queued at once, so C_down(k) is their
    running sum). Exposed is C_up(n) of the last unit; with `behind` > 0
    (ZeRO-3, whose weights' first reader is their gather in the next
    forward) the up copies still running when the CPU is done, C_up(n) -
    C_cpu(n), hide behind `behind` seconds of that forward: exposed is
    C_cpu(n) + max(0, C_up(n) - C_cpu(n) - behind). Hidden is what the three
    would take one after the other less the exposed part.
    """
    down = cpu = up = serial = 0.0
    for x in units:
        times = (x * MAIN_GRAD_BYTES / hw.host_bandwidth,
                 x * hw.gpus_per_node / CPU_ADAM_ELEMENTS_PER_S,
                 x * weight_bytes / hw.host_bandwidth)
        down += times[0]
        cpu = max(cpu, down) + times[1]
        up = max(up, cpu) + times[2]
        serial += sum(times)
    exposed = cpu + max(0.0, up - cpu - behind) if behind > 0 else up
    return OffloadTime(exposed=exposed, hidden=serial - exposed)


def compute_floor(profile: ModelProfile, layout: Layout, hw: HardwareSpec, *, seq_len: int,
                  dtype: str, extra_recompute: float = 0.0) -> float:
    """A lower bound of `step_cost(...).step_time`: compute and recompute plus their bubble.

    The step is at least m times the mean stage's work plus the bubble (a split
    backward's less the weight gradients that fill it), both without any
    communication; plan search prices layouts fully only while
    this bound can still beat the ones it has. `extra_recompute` is
    recompute seconds per micro-batch, over all stages, beyond what the
    layout's own policies rerun (search's bound for a mix not yet chosen).
    """
    times = floor_layer_times(profile, layout, hw, seq_len=seq_len, dtype=dtype)
    work = layout.layers * (times.forward + times.backward) + times.pre + times.post
    work += sum(times.recompute[pol] * n for pol, n in layout.policy_counts()) + extra_recompute
    mean_stage = work / layout.pp
    idle = mean_stage
    if layout.schedule in SPLIT_BACKWARD:  # the Ws fill the bubble (`step_cost`)
        idle -= 2 * (layout.layers * times.weight_grad + times.post_weight_grad) / layout.pp
    return layout.microbatches * mean_stage + (layout.pp - 1) / layout.vstages * max(0.0, idle)


def floor_layer_times(profile: ModelProfile, layout: Layout, hw: HardwareSpec, *, seq_len: int,
                      dtype: str) -> LayerTimes:
    """One layer's kernel times per micro-batch under `layout` (no communication), as
    `compute_floor` counts them."""
    return layer_times(profile, rates(hw, dtype), bb=layout.micro_batch,
                       ss=layout.rank_seq(seq_len), seq_len=seq_len,
                       split=Split(tp=layout.tp, kv_divisor=profile.kv_divisor(layout.tp),
                                   sp=layout.sp, cp=layout.cp), fused=layout.fused)


def _most_layers(layout: Layout) -> int:
    """Layers of the pipeline rank holding most."""
    return max(len(layout.stage_layers(i)) for i in range(layout.pp))


def _max_stage_elements(profile: ModelProfile, layout: Layout, held: bool = False) -> float:
    """Parameter elements per tp rank on the stage holding most (the first or the last when
    the layers split evenly, any stage when they do not); `held`: of those, what one rank
    holds under expert parallelism (1/ep of the routed experts)."""
    def per_rank(stage: int) -> float:
        split, whole, _ = stage_params(profile, layout, stage)
        experts = stage_experts(profile, layout, stage, layout.tp) if held else 0
        return split / layout.tp + whole - experts * (layout.ep - 1) / layout.ep
    stages = range(layout.pp) if layout.chunk_layers else (0, layout.last_rank)
    return max(per_rank(stage) for stage in stages)


def _stage_units(profile: ModelProfile, layout: Layout, stage: int) -> list[float]:
    """Parameter elements per tp rank of each unit pipeline rank `stage` holds, in the order
    of first use: the embedding (first stage), each layer, the final norm and head (last
    stage; with pp > 1 the head's copy of a tied embedding too). They add up to
    `stage_params`."""
    pr, tp = profile.params, layout.tp
    split, whole = layer_params(profile, tp)
    units = [split / tp + whole] * len(layout.stage_layers(stage))
    if stage == 0:
        units.insert(0, pr["pre"].split / tp + pr["pre"].replicated)
    if stage == layout.last_rank:
        tied = profile.tied_elements if profile.tied and layout.pp > 1 else 0
        units.append((pr["post"].split + tied) / tp + pr["post"].replicated)
    return [u for u in units if u > 0]


def _dp_exposed(profile: ModelProfile, layout: Layout, group: AxisGroup, hw: HardwareSpec,
                prec: Precision, slowest: _Stage, algos: dict[str, str], memo: dict | None
                ) -> tuple[float, float]:
    """(exposed, issued) seconds of the once-per-step gradient sync (ZeRO 0-2)."""
    if group.size == 1:
        return 0.0, 0.0
    # Under expert parallelism a rank reduces its 1/ep of the experts (over fewer ranks).
    elements = _max_stage_elements(profile, layout, held=True)
    if layout.zero == 0:
        ar = _cached(memo, ("ar", elements, group, prec.grad_wire), lambda: comm.all_reduce(
            elements * prec.grad_wire, group, hw))
        algos["dp"] = ar.algorithm
        grad_sync, gather = ar.seconds, 0.0
    else:
        rs, ag = _cached(memo, ("rs+ag", elements, group, prec.grad_wire), lambda: (
            comm.reduce_scatter(elements * prec.grad_wire, group, hw),
            comm.all_gather(elements * prec.weight, group, hw)))
        algos["dp"] = f"rs:{rs.algorithm} ag:{ag.algorithm}"
        grad_sync, gather = rs.seconds, ag.seconds
    if not layout.overlap:
        return grad_sync + gather, grad_sync + gather
    # Buckets reduce while the last micro-batch's backward runs; the gather feeds the next
    # forward, each unit's waited for where it first reads it (`ptc.ops.weight_gathers`).
    backward = slowest.compute - slowest.forward + slowest.recompute
    forward = slowest.forward
    return max(0.0, grad_sync - backward) + max(0.0, gather - forward), grad_sync + gather
