"""Step time: compute + exposed communication + pipeline bubble + optimizer step.

Terms: F is a layer's forward FLOPs for one micro-batch (from the graph),
R = peak · achievable_fraction the FLOP rate a tuned step reaches, T_i the
time stage i spends on one micro-batch (its layers' forward, backward = 2F,
recompute, and the communication it cannot hide).

- compute: F / t / R per layer forward, 2F / t / R backward; recompute adds
  F (full) or the attention core's FLOPs (selective).
- tensor parallel: two all-reduces of b·s·h elements per layer forward, two
  backward, two more in a full recompute; with sequence parallelism each is
  a reduce-scatter plus an all-gather of the same size. They sit on the
  critical path, except that with sequence parallelism and overlap they run
  under the layer's GEMMs (Megatron's tp-comm-overlap): only the excess shows.
- pipeline: one boundary activation forward and one gradient backward per
  micro-batch per chunk, 1/t of it per rank (scatter/gather, or SP). With
  overlap only the fill and drain hops are exposed; without, every one is.
  Step = m · max_i T_i + (p - 1)/v · mean_i T_i; the second part is the bubble.
- data parallel: ZeRO-0 all-reduces the gradients; ZeRO-1/2 reduce-scatter
  them and all-gather the updated weights; with overlap these hide behind
  the last micro-batch's backward and the next forward. ZeRO-3 gathers each
  layer's weights for every forward (the recompute forward included) and
  again for backward, and reduce-scatters its gradients, every micro-batch;
  with overlap each layer's traffic hides behind that layer's compute.
- optimizer: memory-bound; it reads gradient and state and writes state and
  weight once per parameter shard, at the device memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ptc.compiler import comm
from ptc.compiler.layout import Layout
from ptc.compiler.memory import Precision, stage_params
from ptc.compiler.profile import ModelProfile
from ptc.compiler.topology import AxisGroup, axis_groups
from ptc.plan import HardwareSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class StepCost:
    """Predicted time of one optimizer step and where it goes."""

    step_time: float
    """Seconds per step."""
    breakdown: dict[str, float]
    """Seconds by part: compute, recompute, tp_comm, pp_comm, dp_comm, bubble, optimizer."""
    model_flops: float
    """FLOPs of one step without recompute (forward + backward = 3x forward), all GPUs."""
    hw_flops: float
    """FLOPs of one step including recomputed forwards, all GPUs."""
    algorithms: dict[str, str] = field(default_factory=dict)
    """Collective algorithm per traffic kind ("tp", "dp", ...)."""


@dataclass(slots=True)
class _Stage:
    compute: float = 0.0
    recompute: float = 0.0
    tp: float = 0.0
    pp: float = 0.0
    dp: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.tp + self.pp + self.dp


def _tp_collectives(size: float, layout: Layout, group: AxisGroup, hw: HardwareSpec,
                    count: int) -> tuple[float, str]:
    """Seconds of `count` TP all-reduces of `size` bytes (RS + AG pairs with SP)."""
    if layout.sp:
        rs, ag = comm.reduce_scatter(size, group, hw), comm.all_gather(size, group, hw)
        return count * (rs.seconds + ag.seconds), f"rs+ag:{rs.algorithm}"
    ar = comm.all_reduce(size, group, hw)
    return count * ar.seconds, ar.algorithm


def step_cost(profile: ModelProfile, layout: Layout, hw: HardwareSpec, prec: Precision,
              *, seq_len: int, dtype: str) -> StepCost:
    """Predict one optimizer step of `layout` (see module docstring)."""
    f, tp, p, v, mb = profile.fn, layout.tp, layout.pp, layout.vstages, layout.microbatches
    bb, ss = layout.micro_batch, seq_len
    rate = hw.peak_flops[dtype] * hw.achievable_fraction
    groups = axis_groups({"tp": tp, "pp": p, "dp": layout.dp}, layout.order, hw.gpus_per_node)
    algos: dict[str, str] = {}

    layer_f, core_f = f["flops.layer"](bb, ss) / tp, f["core_flops"](bb, ss) / tp
    boundary = prec.weight * f["boundary"](bb, ss)
    layer_params = profile.params["layer"]
    layer_weight_bytes = prec.weight * (layer_params.split / tp + layer_params.replicated)

    # Per-layer communication, by recompute policy.
    tp_layer = {}
    for policy in ("none", "selective", "full"):
        count = 6 if policy == "full" else 4
        tp_layer[policy], algos["tp"] = _tp_collectives(boundary, layout, groups["tp"], hw, count)
    z3 = {}
    if layout.zero >= 3:
        ag = comm.all_gather(layer_weight_bytes, groups["dp"], hw)
        rs = comm.reduce_scatter(layer_weight_bytes / prec.weight * prec.grad, groups["dp"], hw)
        algos["dp"] = f"ag:{ag.algorithm} rs:{rs.algorithm}"
        for policy in ("none", "selective", "full"):
            z3[policy] = (3 if policy == "full" else 2) * ag.seconds + rs.seconds

    p2p = comm.send_recv(boundary / tp, groups["pp"], hw)
    stages = []
    for i in range(p):
        st = _Stage()
        for layer in layout.stage_layers(i):
            policy = layout.checkpoint[layer]
            work = 3 * layer_f / rate
            extra = {"none": 0.0, "selective": core_f / rate, "full": layer_f / rate}[policy]
            st.compute += work
            st.recompute += extra
            hide = work + extra if layout.overlap else 0.0
            st.tp += max(0.0, tp_layer[policy] - hide) if layout.sp or not layout.overlap \
                else tp_layer[policy]
            if z3:
                st.dp += max(0.0, z3[policy] - hide)
        if i == 0:
            st.compute += 3 * f["flops.pre"](bb, ss) / tp / rate
        if i == p - 1:
            st.compute += 3 * f["flops.post"](bb, ss) / tp / rate
        if i in (0, p - 1) and tp > 1:  # vocab-parallel embedding forward, head input backward
            st.tp += _tp_collectives(boundary, layout, groups["tp"], hw, 1)[0]
        if not layout.overlap:
            st.pp += 2 * v * p2p.seconds
        stages.append(st)

    slowest = max(stages, key=lambda x: x.total)
    mean = sum(x.total for x in stages) / p
    bubble = (p - 1) / v * mean
    fill = 2 * (p - 1) * p2p.seconds if layout.overlap else 0.0
    dp_exposed = _dp_exposed(profile, layout, groups["dp"], hw, prec, slowest, algos) \
        if layout.zero < 3 else 0.0
    if layout.zero >= 3 and not layout.overlap:
        dp_exposed = 0.0  # already counted in full per stage
    opt_elements = max(sum(stage_params(profile, layout, i)[:2]) for i in range(p))
    opt_elements /= (layout.dp if layout.zero >= 1 else 1)
    optimizer = opt_elements / tp * (2 * prec.optimizer + prec.grad + prec.weight) / hw.mem_bandwidth

    breakdown = {
        "compute": mb * slowest.compute,
        "recompute": mb * slowest.recompute,
        "tp_comm": mb * slowest.tp,
        "pp_comm": mb * slowest.pp + fill,
        "dp_comm": mb * slowest.dp + dp_exposed,
        "bubble": bubble,
        "optimizer": optimizer,
    }
    per_micro = 3 * (profile.layers * f["flops.layer"](bb, ss) + f["flops.pre"](bb, ss)
                     + f["flops.post"](bb, ss))
    recomputed = sum({"none": 0.0, "selective": f["core_flops"](bb, ss),
                      "full": f["flops.layer"](bb, ss)}[c] for c in layout.checkpoint)
    micro_total = mb * layout.dp
    return StepCost(step_time=sum(breakdown.values()), breakdown=breakdown,
                    model_flops=per_micro * micro_total,
                    hw_flops=(per_micro + recomputed) * micro_total, algorithms=algos)


def _dp_exposed(profile: ModelProfile, layout: Layout, group: AxisGroup, hw: HardwareSpec,
                prec: Precision, slowest: _Stage, algos: dict[str, str]) -> float:
    """Exposed seconds of the once-per-step gradient sync (ZeRO 0-2)."""
    if group.size == 1:
        return 0.0
    elements = max(stage_params(profile, layout, i)[0] / layout.tp + stage_params(profile, layout, i)[1]
                   for i in range(layout.pp))
    if layout.zero == 0:
        ar = comm.all_reduce(elements * prec.grad, group, hw)
        algos["dp"] = ar.algorithm
        grad_sync, gather = ar.seconds, 0.0
    else:
        rs = comm.reduce_scatter(elements * prec.grad, group, hw)
        ag = comm.all_gather(elements * prec.weight, group, hw)
        algos["dp"] = f"rs:{rs.algorithm} ag:{ag.algorithm}"
        grad_sync, gather = rs.seconds, ag.seconds
    if not layout.overlap:
        return grad_sync + gather
    # Buckets reduce while the last micro-batch's backward runs; the gather feeds the next forward.
    backward = (slowest.compute * 2 / 3 + slowest.recompute)
    forward = slowest.compute / 3
    return max(0.0, grad_sync - backward) + max(0.0, gather - forward)
