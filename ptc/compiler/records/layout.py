"""A resolved parallel layout: the numbers the memory and cost models read.

A `Plan` is what the user wrote (tp may be "auto", checkpoint "auto");
a `Layout` is one concrete choice, cheap to make by the thousand in plan
search. Terms: t, p, d the tp/pp/dp degrees, v the virtual stages (model
chunks per pipeline rank), b the micro-batch, m the micro-batches per step
per pipeline, L the layers.
"""

from __future__ import annotations

import functools

from collections import Counter
from dataclasses import dataclass

from ptc.plan import Plan, stage_rank


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
    """v (1 unless the schedule is interleaved, zero_bubble with chunks, or zbv)."""
    micro_batch: int
    """b."""
    microbatches: int
    """m."""
    zero: int
    """ZeRO stage 0-3."""
    sp: bool
    """Sequence parallelism."""
    schedule: str
    """"gpipe", "1f1b", "interleaved", "zero_bubble" or "zbv" (`ptc.plan.SCHEDULES`)."""
    layers: int
    """L."""
    checkpoint: str | tuple[str, ...]
    """Recompute policy, "none", "selective" or "full": one for all layers, or one per layer."""
    overlap: bool
    """Communication overlapped with compute where the schedule allows."""
    cp: int = 1
    """Context-parallel degree: each rank holds 1/cp of every sample's sequence."""
    ep: int = 1
    """Expert-parallel degree, folded from dp·cp: each rank holds 1/ep of the routed experts."""
    order: tuple[str, ...] = ("tp", "cp", "dp", "pp")
    """Mesh axes, innermost first."""
    offload: bool = False
    """fp32 masters and optimizer state in host memory, stepped on the CPU (ZeRO >= 1)."""
    fused: bool = False
    """Memory-bound ops run as fused kernels (`runtime.compile`; `ptc.compiler.graph.work`)."""
    tp_comm: str = "sync"
    """Sequence parallelism's collectives whole ("sync") or as collective matmuls beside
    their GEMMs ("async"; `parallel.tp_comm`)."""
    chunk_layers: tuple[int, ...] = ()
    """Layers of each of the p·v chunks in pipeline order (chunk c runs on rank
    `stage_rank(c)`: c % p, or in a V for zbv) when they differ
    (`ParallelSpec.stage_layers`); () when each holds L/(p·v)."""

    def __post_init__(self) -> None:
        if self.chunk_layers and (len(self.chunk_layers) != self.pp * self.vstages
                                  or sum(self.chunk_layers) != self.layers):
            raise ValueError(f"chunk_layers {self.chunk_layers} do not split {self.layers} "
                             f"layers into pp({self.pp}) * vstages({self.vstages}) chunks")

    @property
    def grad_ranks(self) -> int:
        """Ranks gradients are averaged over and ZeRO shards over: dp·cp."""
        return self.dp * self.cp

    def rank_seq(self, seq_len: int) -> int:
        """Positions of each sample one rank holds: seq_len / cp."""
        return seq_len // self.cp

    @property
    def last_rank(self) -> int:
        """The pipeline rank holding the last stage (the head and the loss): p - 1, or the
        first rank under a V-shaped schedule."""
        return stage_rank(self.pp * self.vstages - 1, self.pp, self.schedule)

    def stage_layers(self, stage: int) -> list[int]:
        """Indices of the layers pipeline rank `stage` holds (all its chunks)."""
        return [layer for chunk in self.chunks(stage) for layer in chunk]

    def chunks(self, stage: int) -> list[range]:
        """The layers of each of pipeline rank `stage`'s chunks, in chunk order."""
        return list(_chunks(self.pp, self.vstages, self.schedule, self.layers, self.chunk_layers,
                            stage))

    def policy(self, layer: int) -> str:
        """The recompute policy of `layer`."""
        return self.checkpoint if isinstance(self.checkpoint, str) else self.checkpoint[layer]

    def stage_policies(self, stage: int) -> tuple[tuple[str, int], ...]:
        """(policy, layers) pairs of the layers `stage` holds, sorted by policy."""
        if isinstance(self.checkpoint, str):
            return ((self.checkpoint, len(self.stage_layers(stage))),)
        return tuple(sorted(Counter(self.checkpoint[i] for i in self.stage_layers(stage)).items()))

    def policy_counts(self) -> tuple[tuple[str, int], ...]:
        """(policy, layers) pairs over the whole model."""
        if isinstance(self.checkpoint, str):
            return ((self.checkpoint, self.layers),)
        return tuple(sorted(Counter(self.checkpoint).items()))


def layout_of(plan: Plan, checkpoint: str | tuple[str, ...] | None = None) -> Layout:
    """The layout of a resolved plan (no "auto" axis).

    `checkpoint` overrides the plan's policy (estimate resolves "auto" this way). An
    uneven split the plan gives (`ParallelSpec.stage_layers`) is the layout's
    `chunk_layers`.
    """
    par = plan.parallel
    if checkpoint is None:
        checkpoint = par.checkpoint
    layers = plan.model.layers
    split = par.stage_layers(layers) if par.pins_layers and layers else ()
    return Layout(tp=par.tp, pp=par.pp, dp=par.dp, cp=par.cp, ep=par.ep,
                  vstages=par.virtual_stages,
                  micro_batch=plan.train.micro_batch, microbatches=plan.num_microbatches,
                  zero=par.zero, sp=par.sequence_parallel and par.tp > 1, schedule=par.schedule,
                  layers=plan.model.layers, checkpoint=checkpoint, overlap=par.overlap,
                  order=par.order, chunk_layers=split if len(set(split)) > 1 else (),
                  offload=par.offload == "optimizer", fused=plan.runtime.compile,
                  tp_comm=par.tp_comm if par.sequence_parallel and par.tp > 1 else "sync")


@functools.lru_cache(maxsize=4096)
def _chunks(pp: int, vstages: int, schedule: str, layers: int, chunk_layers: tuple[int, ...],
            stage: int) -> tuple[range, ...]:
    """`Layout.chunks`, remembered: plan search asks for the same few thousand times over."""
    indices = [c for c in range(pp * vstages) if stage_rank(c, pp, schedule) == stage]
    if not chunk_layers:
        per_chunk = layers // (pp * vstages)
        return tuple(range(c * per_chunk, (c + 1) * per_chunk) for c in indices)
    first = [0]
    for n in chunk_layers:
        first.append(first[-1] + n)
    return tuple(range(first[c], first[c + 1]) for c in indices)

