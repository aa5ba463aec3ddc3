"""The rank's parameter storage: flat buffers per unit, bound into the graph module.

Per unit (see `ptc.compiler.records.program`) a dp rank holds, by ZeRO stage:

| stage | weights the graph reads        | fp32 master the optimizer updates | gradient      |
|-------|--------------------------------|-----------------------------------|---------------|
| 0     | full buffer, compute dtype     | full (the same buffer when fp32)  | full          |
| 1     | full buffer                    | shard r (a view of full when fp32)| full          |
| 2     | full buffer                    | shard r                           | fp32 shard r  |
| 3     | gathered by the graph per use  | shard r = the graph's zero.shard_i| fp32 shard r  |

At ZeRO 0-1 the gradient buffer has `train.grad_dtype`: fp32 (the masters
read it in place), or the compute dtype, and then the optimizer steps from
`main`, an fp32 copy of what the rank updates, refilled once per step after
every reduction (`fill_main_grads`).

With optimizer offload (`ptc.runtime.offload`) the master and its gradient
are fp32 host tensors instead; at ZeRO-3 the graph's shard then stays on
the device as `shard`, refreshed from the master after each update.

At ZeRO 0-2 the graph's parameters are views into the unit's full buffer,
so the all-gather after an optimizer step updates them in place and a
unit's gradient is one contiguous buffer to reduce. Padding elements are
zero and stay zero (zero gradient, zero weight decay).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from ptc.compiler.records.params import ParamLayout, ParamSlot, ShardUnit
from ptc.errors import PtcError
from ptc.ops.comm import Group, Work, all_gather_flat

Placement = tuple[Group, int, int]
"""A unit's group, this rank's place in it, and its size (`build_units`)."""

@dataclass(eq=False)
class UnitState:
    """One unit's tensors on this rank (see the module table)."""

    spec: ShardUnit
    slots: list[ParamSlot]
    master: torch.Tensor
    """fp32 values the optimizer updates: the full buffer (ZeRO-0) or this rank's shard (on
    the host with optimizer offload)."""
    grad: torch.Tensor
    """fp32 gradient accumulator: full (ZeRO 0-1) or this rank's shard (ZeRO 2-3)."""
    full: torch.Tensor | None = None
    """Full buffer in the compute dtype that the graph's parameters view (ZeRO 0-2)."""
    params: list[nn.Parameter] = field(default_factory=list)
    """The graph's parameters, in slot order (ZeRO 0-2)."""
    main: torch.Tensor | None = None
    """fp32 copy of a 16-bit gradient, the master's `.grad` (ZeRO 0-1 with a 16-bit
    train.grad_dtype); None when the master reads `grad` itself."""
    shard: torch.Tensor | None = None
    """ZeRO-3 with optimizer offload: the graph's fp32 parameter shard on the device, which
    the update refreshes from the host master (without offload the master is that shard)."""
    group: Group = None
    """The ranks the unit is sharded and its gradient reduced over: dp·cp, or for an expert
    unit (`ShardUnit.expert`) the ranks that hold the same experts."""
    rank: int = 0
    """This rank's place in `group`: the shard it owns."""
    world: int = 1
    """Ranks in `group`: the unit's shards."""


def slot_ranges(units: list[UnitState], keep: Callable[[ParamSlot], bool], *,
                whole: bool) -> list[list[tuple[int, int]]]:
    """Per unit, the ranges of the slots `keep` accepts within the whole flat buffer or the
    rank's own shard of it, relative to that buffer's start (padding is never included)."""
    out = []
    for unit in units:
        n = unit.spec.shard_numel
        base, end = (0, unit.spec.padded_numel) if whole else (unit.rank * n, (unit.rank + 1) * n)
        ranges = []
        for slot in unit.slots:
            if not keep(slot):
                continue
            a, b = max(slot.offset, base), min(slot.offset + slot.numel, end)
            if a < b:
                ranges.append((a - base, b - base))
        out.append(ranges)
    return out


def build_units(gm: fx.GraphModule, layout: ParamLayout, values: Mapping[str, torch.Tensor], *,
                zero: int, dtype: torch.dtype, place: Callable[[ShardUnit], Placement],
                device: torch.device, grad_dtype: torch.dtype = torch.float32,
                frozen: Callable[[ParamSlot], bool] = lambda slot: False) -> list[UnitState]:
    """Create this rank's buffers from full initial `values` and bind them into `gm`
    (`place`: each unit's group, this rank's place in it and its size; `grad_dtype`: of
    the ZeRO 0-1 gradient buffers, see the module docstring). A parameter
    `frozen` says the model does not train is bound with requires_grad = False (ZeRO 0-2,
    where each is a tensor of its own): autograd computes no gradient for it, as in eager
    PyTorch. Under ZeRO-3 the graph reads flat shards that mix such parameters with trained
    ones: theirs are computed and dropped (`drop_grads`)."""
    units = []
    for index, spec in enumerate(layout.units):
        slots = layout.slots(index)
        group, rank, world = place(spec)
        full32 = torch.zeros(spec.padded_numel, dtype=torch.float32, device=device)
        for slot in slots:
            full32[slot.offset:slot.offset + slot.numel] = values[slot.name].reshape(-1)
        shard32 = full32.view(world, -1)[rank]
        if zero == 3:
            master = nn.Parameter(shard32.clone())
            gm.zero.register_parameter(f"shard_{index}", master)
            unit = UnitState(spec=spec, slots=slots, master=master, grad=torch.zeros_like(master),
                             group=group, rank=rank, world=world)
        else:
            full = full32 if dtype == torch.float32 else full32.to(dtype)
            if zero == 0:
                master = full32
            else:
                master = shard32 if dtype == torch.float32 else shard32.clone()
            grad = torch.zeros(spec.padded_numel if zero < 2 else spec.shard_numel,
                               dtype=grad_dtype if zero < 2 else torch.float32, device=device)
            unit = UnitState(spec=spec, slots=slots, master=master, grad=grad, full=full,
                             params=[_bind_param(gm, full, slot, trained=not frozen(slot))
                                     for slot in slots], group=group, rank=rank, world=world)
        # ZeRO-1 keeps full gradients but updates only its shard of them.
        owned = unit.grad.view(world, -1)[rank] if zero == 1 else unit.grad
        if owned.dtype != torch.float32:
            unit.main = torch.zeros(owned.shape, dtype=torch.float32, device=device)
        unit.master.grad = owned if unit.main is None else unit.main
        units.append(unit)
    return units


def drop_grads(units: Iterable[UnitState], ranges: list[list[tuple[int, int]]]) -> None:
    """Zero `ranges[i]` of unit i's gradient buffer: the gradients of parameters the model
    does not train (requires_grad = False), which eager PyTorch never computes and ZeRO-3's
    graph does (`build_units`); call once the step's sums are complete, before anything
    reads them (the guard, the norm)."""
    with torch.no_grad():
        for unit, spans in zip(units, ranges):
            for a, b in spans:
                unit.grad[a:b].zero_()


def fill_main_grads(units: Iterable[UnitState]) -> None:
    """Copy each 16-bit gradient (the part this rank updates) into its fp32 `main`, which
    the optimizer, the clip and the norm read; call once the step's sums are complete."""
    with torch.no_grad():
        for unit in units:
            if unit.main is not None:
                owned = unit.grad if unit.main.numel() == unit.grad.numel() else \
                    unit.grad.view(unit.world, -1)[unit.rank]
                unit.main.copy_(owned)


def _bind_param(gm: fx.GraphModule, full: torch.Tensor, slot: ParamSlot, *,
                trained: bool) -> nn.Parameter:
    param = nn.Parameter(full[slot.offset:slot.offset + slot.numel].view(slot.shape),
                         requires_grad=trained)
    for alias in slot.aliases:  # tied weights: one Parameter under every name
        owner, _, leaf = alias.rpartition(".")
        (gm.get_submodule(owner) if owner else gm)._parameters[leaf] = param
    return param


def bind_buffers(gm: fx.GraphModule, values: Mapping[str, torch.Tensor],
                 device: torch.device) -> None:
    """Replace the graph module's meta buffers by real ones; fail on anything left on meta."""
    for name, value in values.items():
        owner, _, leaf = name.rpartition(".")
        (gm.get_submodule(owner) if owner else gm)._buffers[leaf] = value.to(device)
    left = [n for n, t in (*gm.named_parameters(), *gm.named_buffers()) if t.is_meta]
    if left:
        raise PtcError(f"tensors still on the meta device after initialisation: {left}")


def publish(units: Iterable[UnitState], *, zero: int,
            leave: Callable[[int, Work], None] | None = None) -> None:
    """Make the graph's weights equal the updated masters (cast, then all-gather shards).

    Ordered on the device's stream: what runs next reads the new weights. With
    `leave`, the ZeRO 1-2 all-gathers are not waited for: `leave(index, work)`
    gets each unit's (its index in `units`), for the next forward to wait on
    where it first reads that unit (`ptc.ops.weight_gathers`).
    (Optimizer offload publishes unit by unit as it steps: `ptc.runtime.offload`.)"""
    works: list[tuple[int, Work]] = []
    with torch.no_grad():
        for index, unit in enumerate(units):
            if unit.full is None:  # ZeRO-3: the graph gathers from its shards itself
                if unit.shard is not None:
                    unit.shard.copy_(unit.master)
                continue
            if zero == 0:
                if unit.full.data_ptr() != unit.master.data_ptr():
                    unit.full.copy_(unit.master)
                continue
            mine = weight_shard(unit)
            if mine.data_ptr() != unit.master.data_ptr():
                mine.copy_(unit.master)
            works.append((index, gather_full(unit)))
    for index, work in works:
        if leave is None:
            work.wait()
        else:
            leave(index, work)


def weight_shard(unit: UnitState) -> torch.Tensor:
    """This rank's part of the weights the graph reads, in the compute dtype (ZeRO 1-3): its
    1/dp of the full buffer (ZeRO 1-2) or the shard the graph gathers (ZeRO-3)."""
    if unit.full is None:
        return unit.shard if unit.shard is not None else unit.master
    return unit.full.view(unit.world, -1)[unit.rank]


def gather_full(unit: UnitState) -> Work:
    """Start all-gathering every rank's `weight_shard` into the unit's full buffer (ZeRO 1-2)."""
    # A copy of our shard as input: the output buffer must not alias the input.
    return all_gather_flat(weight_shard(unit).clone(), unit.group, out=unit.full)


def held_bytes(gm: fx.GraphModule, units: Iterable[UnitState],
               optimizer_state: Iterable[torch.Tensor],
               host: Iterable[torch.Tensor] = ()) -> dict[str, int]:
    """Bytes this rank holds per category, counting each storage once.

    params: the graph module's parameters (full buffers, or ZeRO-3 shards);
    grads: gradient accumulators and any `.grad` left on the graph's
    parameters; optimizer: state tensors (0-dim step counters excluded) and
    master copies that are not already counted; host: the tensors optimizer
    offload keeps in host memory (`host`: masters, their gradients and the
    optimizer's state, counters excluded), counted before the others.
    """
    seen: set[int] = set()

    def total(tensors: Iterable[torch.Tensor | None]) -> int:
        count = 0
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                count += storage.nbytes()
        return count

    units = list(units)
    params = list(gm.parameters())
    on_host = total([t for t in host if t.dim() > 0])
    return {"params": total(params),
            "grads": total([u.grad for u in units] + [u.main for u in units]
                           + [p.grad for p in params]),
            "optimizer": total([t for t in optimizer_state if t.dim() > 0] +
                               [u.master for u in units]),
            "host": on_host}
