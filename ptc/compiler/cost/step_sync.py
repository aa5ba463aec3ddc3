"""Collectives ptc's runtime issues once a step beside the model's traffic: their latency.

After the last backward and before the next forward the runtime
(`ptc.runtime.executor.Trainer.train_step`) runs, one after the other and
with nothing to hide behind:

- the non-finite guard: one all-reduce over every rank of a flag per rank,
  the loss and the parts of the squared gradient norm clipping takes
  (`ptc.runtime.health.nonfinite_ranks_and_sum`,
  `ptc.runtime.optimizer.ShardedOptimizer.norm_share`), except where it
  rides the step's last gradient all-reduce (`guard_folds`: pure data
  parallel at ZeRO-0, fp32 gradients reduced in fp32, no offload;
  `ptc.runtime.health.FoldedGuard`), a few bytes more on that all-reduce,
  every rank then holding the whole gradient the norm is taken of;
- with ZeRO 1-2, the updated weights are all-gathered unit by unit
  (`ptc.runtime.params.publish`): the embedding, each layer, the final norm
  and head of the stage. The step-time model prices the stage's weights as
  one all-gather; each further unit adds that all-gather's latency part, the
  difference between gathering the units one by one and all at once.

Their sizes are a few bytes (or, for the gathers, the stage's weights in
pieces), so on GPUs they cost tens of microseconds a step; where collectives
take milliseconds (processes sharing a CPU), they are a large part of it.
"""

from __future__ import annotations

from ptc.compiler.cost import collectives as comm
from ptc.compiler.records.layout import Layout
from ptc.compiler.memory.model import MAIN_GRAD_BYTES, Precision
from ptc.compiler.profile.types import ModelProfile
from ptc.compiler.cost.topology import AxisGroup
from ptc.plan import HardwareSpec

FLAG_BYTES = 4
"""Bytes of one rank's slot in the guard's all-reduce (float32)."""

GUARD_SUMS = 2
"""Slots the guard's all-reduce sums beside the ranks' flags: the loss, the squared norm."""


def world_group(layout: Layout, gpus_per_node: int) -> AxisGroup:
    """Every rank of the job as one group, ranks numbered node by node."""
    world = layout.tp * layout.cp * layout.pp * layout.dp
    return AxisGroup(axis="world", size=world, stride=1, per_node=min(world, gpus_per_node))


def step_sync(profile: ModelProfile, layout: Layout, hw: HardwareSpec, prec: Precision,
              groups: dict[str, AxisGroup]) -> float:
    """Seconds per step of the collectives above (see the module docstring); `groups` are
    the mesh axes' placements (`ptc.compiler.cost.topology.axis_placements`)."""
    world = world_group(layout, hw.gpus_per_node)
    folded = guard_folds(zero=layout.zero, dp=layout.dp, world=world.size,
                         offload=layout.offload, grad_bytes=prec.grad, wire_bytes=prec.grad_wire)
    seconds = 0.0 if folded else \
        comm.all_reduce(FLAG_BYTES * (world.size + GUARD_SUMS), world, hw).seconds
    if layout.zero in (1, 2) and groups["grad"].size > 1:
        seconds += _unit_gathers(profile, layout, hw, prec, groups["grad"])
    return seconds


def guard_folds(*, zero: int, dp: int, world: int, offload: bool, grad_bytes: int,
                wire_bytes: int) -> bool:
    """Whether the non-finite guard rides the gradient all-reduce
    (`ptc.runtime.health.FoldedGuard`): the dp group is the whole job of `world` ranks, at
    ZeRO-0, without optimizer offload, fp32 gradient buffers reduced in fp32. The cost model
    and the runtime's Trainer both ask here."""
    return (zero == 0 and 1 < dp == world and not offload
            and grad_bytes == wire_bytes == MAIN_GRAD_BYTES)


def _unit_gathers(profile: ModelProfile, layout: Layout, hw: HardwareSpec, prec: Precision,
                  group: AxisGroup) -> float:
    """What gathering the updated weights unit by unit takes beyond one gather of them all,
    on the first stage (the embedding's) and the last (the head's), whichever is more."""
    tp, pr = layout.tp, profile.params
    layer = (pr["layer"].split - pr["layer"].kv) / tp + pr["layer"].kv / profile.kv_divisor(tp) \
        + pr["layer"].replicated
    pre = pr["pre"].split / tp + pr["pre"].replicated
    post = pr["post"].split / tp + pr["post"].replicated

    def extra(units: list[float]) -> float:
        one_by_one = sum(comm.all_gather(n * prec.weight, group, hw).seconds for n in units)
        return one_by_one - comm.all_gather(sum(units) * prec.weight, group, hw).seconds

    stages = {0, layout.last_rank}
    return max(extra([*([pre] if s == 0 else []),
                      *[layer] * len(layout.stage_layers(s)),
                      *([post] if s == layout.last_rank else [])]) for s in stages)
