"""Elastic jobs: the plan a restarted group runs when fewer (or more) processes joined.

`ptc run --nnodes MIN:MAX` lets torch's elastic agent restart the group on
the nodes that are left. `launch` then sets `PTC_ELASTIC=1` for the
workers, and each worker adapts the plan to the world it finds: tp and pp
stay, dp becomes world / (tp · pp), and the global batch stays, carried by
more or fewer micro-batches per rank, so every step trains on the same
samples as before. The checkpoint reshards to the new dp on load.
"""

from __future__ import annotations

import dataclasses
import os

from ptc.errors import PtcError
from ptc.plan import Plan

ENV = "PTC_ELASTIC"


def is_elastic_range(nnodes: str | None) -> bool:
    """Whether a `--nnodes` value is a range MIN:MAX with MIN < MAX."""
    if not nnodes or ":" not in nnodes:
        return False
    low, high = nnodes.split(":")
    return int(low) < int(high)


def elastic() -> bool:
    """Whether this worker belongs to an elastic job (its world may differ from the plan's)."""
    return os.environ.get(ENV) == "1"


def plan_for_world(plan: Plan, world: int) -> Plan:
    """`plan` with dp (and the hardware's size) changed so that tp · cp · pp · dp = world."""
    p = plan.parallel
    fixed = p.tp * p.cp * p.pp
    if fixed * p.dp == world:
        return plan
    if world % fixed:
        raise PtcError(f"{world} processes joined: not a multiple of tp({p.tp}) * cp({p.cp}) "
                       f"* pp({p.pp})")
    dp = world // fixed
    if (dp * p.cp) % p.ep:
        raise PtcError(f"{world} processes joined, so dp = {dp}: ep({p.ep}) does not divide "
                       f"dp({dp}) * cp({p.cp}), which the expert shards are folded from")
    if plan.train.global_batch % (plan.train.micro_batch * dp):
        raise PtcError(f"{world} processes joined, so dp = {dp}: global_batch"
                       f"({plan.train.global_batch}) is not divisible by micro_batch"
                       f"({plan.train.micro_batch}) * dp({dp})")
    hw = plan.hardware
    if world % hw.gpus_per_node == 0:
        hardware = dataclasses.replace(hw, nodes=world // hw.gpus_per_node)
    else:
        hardware = dataclasses.replace(hw, nodes=1, gpus_per_node=world)
    parallel = dataclasses.replace(p, dp=dp, microbatches=None)
    return dataclasses.replace(plan, hardware=hardware, parallel=parallel)
