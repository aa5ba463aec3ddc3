"""Where every parameter lives: flat units, their shards and the slots of their parameters.

Terms. A *unit* is a group of parameters that the runtime stores as one flat
buffer, padded to a multiple of dp and cut into dp equal *shards* (rank r of
the dp axis holds shard r). It is the ZeRO-3 gather granularity and, at every
ZeRO stage, the gradient-reduction bucket. Units follow the graph: one per
transformer layer (`layers.{i}`) and one per other top-level module (`embed`,
`pos_embed`, `norm`, `head`), in order of first use, so that backward
completes them in reverse order and each reduction overlaps the rest of
backward. A parameter belongs to the unit of its first use; a tied parameter
(head sharing embed's weight) has one slot and several names (*aliases*).
Under expert parallelism a layer's routed experts form a unit of their own
(`layers.{i}.experts`), sharded over the dp·cp/ep ranks that hold them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Plan dtype name -> the torch dtype the lowered graphs compute in."""
MASTER_BYTES = 4
"""Master weights, gradient buffers and Adam moments are fp32 whatever the compute dtype."""
ADAM_STATES = 2
"""exp_avg and exp_avg_sq."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamSlot:
    """Where one parameter lives: its unit and its element offset in the unit's flat buffer."""

    name: str
    """Canonical name: the first name under which the graph module holds it."""
    aliases: tuple[str, ...]
    """Every name under which the graph module holds it, canonical first (tied weights)."""
    shape: tuple[int, ...]
    """Full (unsharded) shape."""
    unit: int
    """Index of the unit in `ParamLayout.units`."""
    offset: int
    """First element of the parameter in the unit's flat buffer."""

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardUnit:
    """A group of parameters stored as one flat buffer and sharded evenly over dp."""

    name: str
    """"layers.3", "embed", ... (the group key of its first use)."""
    params: tuple[str, ...]
    """Canonical names of its parameters, in buffer order."""
    numel: int
    """Elements of all its parameters."""
    shards: int
    """Number of shards (the dp degree; for an expert unit, dp·cp/ep)."""
    expert: bool = False
    """Whether it holds one ep rank's routed experts (`ptc.compiler.records.ep_layout`): its
    gradient is averaged, and ZeRO shards it, over the ranks holding the same experts (the
    expert-data-parallel group), not over dp."""

    @property
    def shard_numel(self) -> int:
        """Elements per shard; the last shard carries the zero padding."""
        return -(-self.numel // self.shards)

    @property
    def padded_numel(self) -> int:
        """Elements of the full flat buffer: numel rounded up to a multiple of shards."""
        return self.shard_numel * self.shards


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamLayout:
    """The sharding of every parameter: units in order of first use, and each parameter's slot."""

    units: tuple[ShardUnit, ...]
    """Units in order of first use in the forward graph."""
    params: Mapping[str, ParamSlot]
    """Canonical name -> slot, in unit order."""

    def slots(self, unit: int) -> list[ParamSlot]:
        """The slots of one unit, in buffer order."""
        return [self.params[name] for name in self.units[unit].params]

    @property
    def numel(self) -> int:
        """Parameter elements (each tied parameter once, without padding)."""
        return sum(u.numel for u in self.units)

    @property
    def padded_numel(self) -> int:
        """Elements of all full flat buffers, padding included."""
        return sum(u.padded_numel for u in self.units)

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's shards of all units."""
        return sum(u.shard_numel for u in self.units)
