"""The Program: what the compiler hands the runtime.

A Program holds one lowered graph per pipeline stage (graphs are per stage,
not per rank: the dp ranks of a stage share a graph and differ only in the
shards they hold), the *layout* that says where every parameter lives, and
the reports (pass log, predicted step time, per-rank state bytes).

Terms. A *unit* is a group of parameters that the runtime stores as one flat
buffer, padded to a multiple of dp and cut into dp equal *shards* (rank r of
the dp axis holds shard r). It is the ZeRO-3 gather granularity and, at every
ZeRO stage, the gradient-reduction bucket. Units follow the graph: one per
transformer layer (`layers.{i}`) and one per other top-level module (`embed`,
`pos_embed`, `norm`, `head`), in order of first use, so that backward
completes them in reverse order and each reduction overlaps the rest of
backward. A parameter belongs to the unit of its first use; a tied parameter
(head sharing embed's weight) has one slot and several names (*aliases*).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import fx, nn

from ptc.compiler.meta import graph_record
from ptc.compiler.nodes import module_path
from ptc.compiler.overlap import default_overlap
from ptc.compiler.stages import stage_info, tied_names
from ptc.errors import CompileError
from ptc.plan import DTYPE_BYTES

if TYPE_CHECKING:
    from ptc.compiler.decisions import Decisions
    from ptc.compiler.overlap import OverlapPlan
    from ptc.compiler.schedule import Action, Schedule
    from ptc.compiler.stages import StageInfo
    from ptc.compiler.tp_layout import TensorParallelLayout
    from ptc.plan import Plan

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
    """Number of shards (the dp degree)."""

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


def group_key(path: str) -> str:
    """The unit a module path belongs to: "layers.3.attn.qkv" -> "layers.3", "head" -> "head"."""
    parts = path.split(".")
    if len(parts) > 1 and parts[1].isdigit():
        return ".".join(parts[:2])
    return parts[0]


def used_params(gm: fx.GraphModule, node: fx.Node) -> list[tuple[str, nn.Parameter]]:
    """The parameters `node` reads directly, as (name in gm, parameter)."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return [(f"{node.target}.{n}", p) for n, p in module.named_parameters()]
    if node.op == "get_attr":
        owner, _, leaf = str(node.target).rpartition(".")
        value = getattr(gm.get_submodule(owner), leaf)
        if isinstance(value, nn.Parameter):
            return [(str(node.target), value)]
    return []


def param_layout(gm: fx.GraphModule, shards: int, *, own_units: Collection[str] = ()
                 ) -> ParamLayout:
    """Group the parameters of `gm` into units by first use and give each its slot.

    Deterministic in the graph alone, so every rank computes the same layout.
    A parameter named in `own_units` gets a unit of its own (named after it):
    a weight tied across pipeline stages, whose gradient shards the stages
    sum with each other, needs the same unit geometry on every stage.
    """
    names: dict[int, list[str]] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    unit_names: list[str] = []
    members: dict[str, list[nn.Parameter]] = {}
    seen: set[int] = set()
    for node in gm.graph.nodes:
        params = used_params(gm, node)
        if not params:
            continue
        group = group_key(module_path(node) or params[0][0])
        for name, p in params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            key = name if name in own_units else group
            if key not in members:
                unit_names.append(key)
                members[key] = []
            members[key].append(p)
    unused = [ns[0] for pid, ns in names.items() if pid not in seen]
    if unused:
        raise CompileError(f"parameters not used by the graph cannot be placed: {unused}")
    units, slots = [], {}
    for index, key in enumerate(unit_names):
        offset, unit_params = 0, []
        for p in members[key]:
            aliases = tuple(names[id(p)])
            slots[aliases[0]] = ParamSlot(name=aliases[0], aliases=aliases, shape=tuple(p.shape),
                                          unit=index, offset=offset)
            unit_params.append(aliases[0])
            offset += p.numel()
        units.append(ShardUnit(name=key, params=tuple(unit_params), numel=offset, shards=shards))
    return ParamLayout(units=tuple(units), params=slots)


def stage_param_layout(gm: fx.GraphModule, shards: int) -> ParamLayout:
    """The parameter layout of a stage graph: its own parameters, each tied weight a unit of
    its own (so the copies on several stages have the same geometry and summable shards).

    Fixed once at the pipeline split's seam for every stage graph (an unsplit graph is
    one stage) and kept in the Decisions (`with_stage_layouts`): the zero and
    comm_overlap passes, the Program and the runtime read that one layout, so they agree.
    """
    shards_module = getattr(gm, "zero", None)
    if isinstance(shards_module, ZeroShards):  # lowered by the zero pass already: its layout
        return shards_module.layout
    return param_layout(gm, shards, own_units=tied_names(gm))


def with_stage_layouts(decisions: Decisions, whole: fx.GraphModule,
                       stages: Sequence[fx.GraphModule]) -> Decisions:
    """`decisions` with what the seam fixes: the tp layout the whole-graph passes recorded
    on `whole`, and each stage graph's parameter layout."""
    return dataclasses.replace(
        decisions, tensor_parallel=graph_record(whole).tensor_parallel,
        layouts={stage_info(s).index: stage_param_layout(s, decisions.plan.grad_ranks)
                 for s in stages})


def with_overlap(decisions: Decisions, stages: Sequence[fx.GraphModule]) -> Decisions:
    """`decisions` with each stage's overlap plan: the comm_overlap pass's, or where it did
    not run, one bucket per unit (`default_overlap`)."""
    plans = {}
    for stage in stages:
        index = stage_info(stage).index
        plans[index] = graph_record(stage).overlap or default_overlap(
            decisions.stage_layout(index), decisions.plan)
    return dataclasses.replace(decisions, overlap=plans)


def shard_unit(node: fx.Node) -> int:
    """The unit whose shard a `get_attr zero.shard_{i}` node of a ZeRO-3 graph reads."""
    return int(str(node.target).rsplit("_", 1)[1])


class ZeroShards(nn.Module):
    """Holds a ZeRO-3 graph's parameter shards (`shard_{i}` for unit i) and the layout.

    The zero pass replaces every parameter of the graph module by this one
    submodule, so the lowered graph reads shards (`get_attr zero.shard_3`)
    and gathers them explicitly; the runtime fills the shards with its own.
    """

    def __init__(self, layout: ParamLayout):
        super().__init__()
        self.layout = layout
        for i, unit in enumerate(layout.units):
            self.register_parameter(f"shard_{i}", nn.Parameter(
                torch.empty(unit.shard_numel, device="meta")))


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    """One pipeline stage's lowered graph."""

    index: int
    """Pipeline stage number."""
    info: StageInfo
    """Where the stage sits in the pipeline and what crosses its edges (pp = 1: one stage)."""
    graph: fx.GraphModule
    """The lowered graph on the meta device: (tokens, targets) -> mean loss, or, split into
    pipeline stages, the calling convention of `ptc.compiler.stages`."""
    layout: ParamLayout
    """The stage's own parameter layout (pp = 1: the Program's), as the Decisions fix it."""
    overlap: OverlapPlan
    """The stage's buckets and overlap decisions, as the Decisions fix them (one bucket per
    unit where the comm_overlap pass did not run: `ptc.compiler.overlap.default_overlap`)."""


@dataclass(frozen=True, kw_only=True)
class Program:
    """A compiled plan: lowered graphs per stage, the parameter layout, and reports."""

    plan: Plan
    """The plan it was compiled from."""
    decisions: Decisions
    """The plan resolved once before the first pass: per-layer recompute policy, estimate."""
    stages: tuple[Stage, ...]
    """One lowered graph per pipeline stage."""
    layout: ParamLayout
    """Where every parameter lives (units, shards, aliases). Split into pipeline stages, the
    whole model's as captured (names and full shapes: initial values are looked up by it);
    each Stage then has its own."""
    pass_log: tuple[str, ...] = ()
    """What each pass logged, in order ("shard_params_pass: inserted 6 gather_params")."""
    schedule: Schedule
    """The pipeline schedule, checked deadlock-free (pp = 1: the one-stage schedule)."""
    actions: tuple[tuple[Action, ...], ...]
    """What each pipeline rank runs, in order: the schedule lowered to compute actions and
    the sends and receives between them (`ptc.compiler.schedule.lower`)."""
    model: nn.Module | None = None
    """The module `ptc.compile` was given (None: the plan's own model). It is what trains:
    its weights are the initial ones (unless the plan's `init` says otherwise), and the
    processes `ptc.run` starts compile it again."""

    @property
    def vocab(self) -> int | None:
        """Token ids the model takes (0 .. vocab - 1): the plan's `model.vocab`, else, for a
        custom model, the width of the logits capture found."""
        if self.plan.model.vocab is not None:
            return self.plan.model.vocab
        return graph_record(self.stages[0].graph).capture.vocab

    @property
    def frozen(self) -> frozenset[str]:
        """Names of the parameters the model does not train (requires_grad = False)."""
        return frozenset(graph_record(self.stages[0].graph).capture.frozen)

    @property
    def tensor_parallel(self) -> TensorParallelLayout | None:
        """How tp splits each parameter (None when tp = 1); the layout's shapes are tp-local."""
        return self.decisions.tensor_parallel

    @property
    def predicted_step_time(self) -> float | None:
        """The cost model's step time in seconds, when the plan was priced."""
        return self.decisions.predicted_step_time

    def state_bytes(self) -> dict[str, int]:
        """Bytes one dp rank holds between steps, per category: params, grads, optimizer, host.

        Exact for this layout (padding included): "params" are the weights the
        graph computes with (full in the compute dtype; fp32 shards at ZeRO-3),
        "grads" the gradient buffers (ZeRO 0-1: full, in `train.grad_dtype`, plus
        with a 16-bit one the fp32 copy the optimizer steps from, of what this rank
        updates; from ZeRO-2 fp32 shards), and "optimizer" the Adam moments plus a
        separate fp32 master copy when the compute dtype is not fp32 (shards from
        ZeRO-1). With optimizer offload "optimizer" is 0 and "host" holds the fp32
        master shard, its fp32 gradient and the moments (`ptc.runtime.offload`);
        otherwise "host" is 0.
        """
        zero = self.plan.parallel.zero
        full, shard = self.layout.padded_numel, self.layout.shard_numel
        compute = DTYPE_BYTES[self.plan.train.compute_dtype]
        grad = DTYPE_BYTES[self.plan.train.grad_dtype]
        moments = ADAM_STATES if self.plan.train.optimizer.name == "adamw" else \
            int(self.plan.train.optimizer.momentum > 0)
        owned = full if zero == 0 else shard  # elements this rank's optimizer updates
        if zero == 3:
            held = {"params": MASTER_BYTES * shard, "grads": MASTER_BYTES * shard,
                    "optimizer": moments * MASTER_BYTES * shard}
        else:
            master = MASTER_BYTES * owned if compute != MASTER_BYTES else 0
            main = MASTER_BYTES * owned if grad != MASTER_BYTES else 0
            held = {"params": compute * full,
                    "grads": grad * full + main if zero < 2 else MASTER_BYTES * shard,
                    "optimizer": moments * MASTER_BYTES * owned + master}
        if self.plan.parallel.offload == "none":
            return {**held, "host": 0}
        return {**held, "optimizer": 0, "host": (moments + 2) * MASTER_BYTES * owned}
