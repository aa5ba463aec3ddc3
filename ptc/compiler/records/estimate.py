"""The `Estimate` record: what ptc predicts for one step of a resolved plan (made by
`ptc.compiler.search.estimate.estimate`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ptc.compiler.records.layout import Layout


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
    optimizer, step_sync)."""
    hbm_bytes: float
    """Memory per GPU of the hardware."""
    budget_bytes: float
    """Bytes a rank may use: hbm_bytes less the plan's memory_margin."""
    layout: Layout
    """The concrete layout estimated (the checkpoint policy resolved per layer)."""
    algorithms: dict[str, str] = field(default_factory=dict)
    """Collective algorithm chosen per traffic kind."""
    host_memory_bytes: float = 0.0
    """Host (CPU) memory one rank needs on the stage needing most: the fp32 masters, optimizer
    state and gradient copy that `parallel.offload = optimizer` keeps there (0 without)."""
    hidden: dict[str, float] = field(default_factory=dict)
    """Seconds of work hidden under other work, by part, not in the step time
    (`StepCost.hidden`: optimizer offload's overlapped copies)."""

    @property
    def fits(self) -> bool:
        """True when every stage fits the memory budget."""
        return self.peak_memory_bytes <= self.budget_bytes

    @property
    def margin_bytes(self) -> float:
        """Bytes of HBM kept out of the budget (the plan's memory_margin)."""
        return self.hbm_bytes - self.budget_bytes
