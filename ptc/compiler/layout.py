"""A resolved parallel layout: the numbers the memory and cost models read.

A `Plan` is what the user wrote (tp may be "auto", checkpoint "auto");
a `Layout` is one concrete choice, cheap to make by the thousand in plan
search. Terms: t, p, d the tp/pp/dp degrees, v the virtual stages (model
chunks per pipeline rank), b the micro-batch, m the micro-batches per step
per pipeline, L the layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ptc.plan import Plan


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """One concrete parallel layout of a model on a set of GPUs."""

    tp: int
    """t."""
    pp: int
    """p."""
    dp: int
    """d."""
    vstages: int
    """v (1 unless the schedule is interleaved)."""
    micro_batch: int
    """b."""
    microbatches: int
    """m."""
    zero: int
    """ZeRO stage 0-3."""
    sp: bool
    """Sequence parallelism."""
    schedule: str
    """"gpipe", "1f1b" or "interleaved"."""
    checkpoint: tuple[str, ...]
    """Per-layer policy: "none", "selective" or "full"."""
    overlap: bool
    """Communication overlapped with compute where the schedule allows."""
    order: tuple[str, ...] = ("tp", "dp", "pp")
    """Mesh axes, innermost first."""

    def stage_layers(self, stage: int) -> list[int]:
        """Indices of the layers pipeline rank `stage` holds (all its chunks)."""
        per_chunk = len(self.checkpoint) // (self.pp * self.vstages)
        return [layer for chunk in range(self.vstages)
                for layer in range((chunk * self.pp + stage) * per_chunk,
                                   (chunk * self.pp + stage + 1) * per_chunk)]


def layout_of(plan: Plan, checkpoint: tuple[str, ...] | None = None) -> Layout:
    """The layout of a resolved plan (no "auto" axis).

    `checkpoint` overrides the plan's policy (estimate resolves "auto" this way).
    """
    par, layers = plan.parallel, plan.model.layers
    if checkpoint is None:
        ckpt = par.checkpoint
        checkpoint = ckpt if isinstance(ckpt, tuple) else (ckpt,) * layers
    return Layout(tp=par.tp, pp=par.pp, dp=par.dp, vstages=par.virtual_stages,
                  micro_batch=plan.train.micro_batch, microbatches=plan.num_microbatches,
                  zero=par.zero, sp=par.sequence_parallel and par.tp > 1, schedule=par.schedule,
                  checkpoint=checkpoint, overlap=par.overlap, order=par.order)
