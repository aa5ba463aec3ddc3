"""`estimate(plan)`: predicted step time, throughput and peak memory of a resolved plan.

Joins the three models: the model's profile (graph-derived per-layer
quantities), the memory model (per stage) and the cost model (per step).
Two FLOP conventions are reported: *model* FLOPs count forward and backward
once (3x forward), *hardware* FLOPs add the recomputed forwards. MFU is
model TFLOP/s per GPU over the dense peak of the plan's dtype.

A plan with checkpoint = "auto" gets, per stage, the mix of none / selective
/ full layers that fits the HBM with the fewest recomputed FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ptc.compiler.cost import StepCost, step_cost
from ptc.compiler.layout import Layout, layout_of
from ptc.compiler.memory import Precision, peak, precision, stage_memory
from ptc.compiler.profile import ModelProfile, model_profile
from ptc.plan import Plan


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """What ptc predicts for one step of a resolved plan."""

    step_time_s: float
    """Seconds per optimizer step."""
    tokens_per_s: float
    """Tokens trained per second, all GPUs."""
    tflops_per_gpu: float
    """Model TFLOP/s per GPU (forward + backward, no recompute)."""
    hw_tflops_per_gpu: float
    """Hardware TFLOP/s per GPU (recomputed forwards included)."""
    mfu: float
    """Model FLOPs utilisation: tflops_per_gpu over the dtype's dense peak."""
    peak_memory_bytes: float
    """Peak bytes on the most loaded rank of any stage."""
    stage_memory_bytes: tuple[float, ...]
    """Peak bytes per pipeline stage."""
    memory_terms: tuple[dict[str, float], ...]
    """Per stage: bytes by term (weights, grads, optimizer, activations, recompute, buffers)."""
    breakdown: dict[str, float]
    """Seconds by part of the step (compute, recompute, tp_comm, pp_comm, dp_comm, bubble,
    optimizer)."""
    hbm_bytes: float
    """Memory per GPU of the hardware."""
    layout: Layout
    """The concrete layout estimated (the checkpoint policy resolved per layer)."""
    algorithms: dict[str, str] = field(default_factory=dict)
    """Collective algorithm chosen per traffic kind."""

    @property
    def fits(self) -> bool:
        """True when every stage fits the HBM."""
        return self.peak_memory_bytes <= self.hbm_bytes


def plan_precision(plan: Plan, profile: ModelProfile) -> Precision:
    """Model-state bytes per parameter for the plan's dtype and optimizer."""
    opt = plan.train.optimizer
    return precision(profile.dtype_bytes, opt.name, opt.momentum)


def estimate(plan: Plan) -> Estimate:
    """Predict step time, throughput and memory of a resolved plan (no "auto" axis)."""
    if not plan.is_resolved:
        raise ValueError("estimate needs tp, pp and dp resolved; use search() for 'auto' axes")
    profile = model_profile(plan.model, plan.train.dtype)
    prec = plan_precision(plan, profile)
    ckpt = plan.parallel.checkpoint
    if ckpt == "auto":
        layout = auto_checkpoint(profile, layout_of(plan, "none"), prec,
                                 plan.train.seq_len, plan.hardware.hbm_bytes)
    else:
        layout = layout_of(plan)
    return estimate_layout(profile, layout, plan, prec)


def estimate_layout(profile: ModelProfile, layout: Layout, plan: Plan, prec: Precision
                    ) -> Estimate:
    """Estimate `layout` of `plan`'s model, hardware and batch (search calls this directly)."""
    hw, train = plan.hardware, plan.train
    mem = stage_memory(profile, layout, prec, train.seq_len)
    cost: StepCost = step_cost(profile, layout, hw, prec, seq_len=train.seq_len, dtype=train.dtype)
    gpus = layout.tp * layout.pp * layout.dp
    step = cost.step_time
    tflops = cost.model_flops / step / gpus / 1e12
    peaks = tuple(peak(terms) for terms in mem)
    return Estimate(
        step_time_s=step,
        tokens_per_s=layout.micro_batch * layout.microbatches * layout.dp * train.seq_len / step,
        tflops_per_gpu=tflops, hw_tflops_per_gpu=cost.hw_flops / step / gpus / 1e12,
        mfu=tflops * 1e12 / hw.peak_flops[train.dtype], peak_memory_bytes=max(peaks),
        stage_memory_bytes=peaks, memory_terms=tuple(mem), breakdown=cost.breakdown,
        hbm_bytes=hw.hbm_bytes, layout=layout, algorithms=cost.algorithms)


def auto_checkpoint(profile: ModelProfile, layout: Layout, prec: Precision, seq_len: int,
                    hbm: float) -> Layout:
    """Per-layer policies that fit `hbm` with the fewest recomputed FLOPs.

    Layers of a stage are alike, so per stage only the counts matter: for each
    number of fully recomputed layers, the fewest selective ones that fit; of
    those, the mix recomputing least. The tightest stage's mix is used for all.
    When nothing fits, every layer is fully recomputed.
    """
    per_stage = len(layout.stage_layers(0))
    f = profile.fn
    layer_cost, core_cost = f["flops.layer"](1, seq_len), f["core_flops"](1, seq_len)
    best = None
    for n_full in range(per_stage + 1):
        for n_sel in range(per_stage - n_full + 1):
            mix = ("full",) * n_full + ("selective",) * n_sel + ("none",) * (per_stage - n_full - n_sel)
            candidate = replace(layout, checkpoint=_spread(mix, layout))
            if max(peak(t) for t in stage_memory(profile, candidate, prec, seq_len)) <= hbm:
                recompute = n_full * layer_cost + n_sel * core_cost
                if best is None or recompute < best[0]:
                    best = (recompute, candidate)
                break  # more selective layers only recompute more
    if best is None:
        return replace(layout, checkpoint="full")
    return best[1]


def _spread(mix: tuple[str, ...], layout: Layout) -> tuple[str, ...]:
    """Give every stage the same per-stage mix, in its own layer order."""
    policy = [""] * layout.layers
    for stage in range(layout.pp):
        for pol, layer in zip(mix, layout.stage_layers(stage)):
            policy[layer] = pol
    return tuple(policy)
