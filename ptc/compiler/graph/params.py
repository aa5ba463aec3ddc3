"""Laying a graph's parameters out in units (`ptc.compiler.records.params`), read off the
graph: which parameters each node uses, their units in order of first use, the ZeRO-3
shards module the zero pass installs."""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import fx, nn

from ptc.compiler.graph.meta import graph_record
from ptc.compiler.graph.nodes import module_path
from ptc.compiler.graph.stage_graphs import tied_names
from ptc.compiler.records.ep_layout import ExpertParallelLayout
from ptc.compiler.records.params import ParamLayout, ParamSlot, ShardUnit
from ptc.errors import CompileError


def group_key(path: str, blocks: str | None = None) -> str:
    """The unit a module path belongs to: its block, where the capture found the model's
    blocks at `blocks` ("model.layers.3.self_attn.q_proj" -> "model.layers.3" for a
    transformers model's "model.layers"); else "layers.3.attn.qkv" -> "layers.3", "head"
    -> "head". A block is a unit of its own, so ZeRO-3 gathers one layer's weights at a
    time, whatever the module path leading to the blocks."""
    if blocks and path.startswith(f"{blocks}."):
        index = path[len(blocks) + 1:].split(".", 1)[0]
        if index.isdigit():
            return f"{blocks}.{index}"
    parts = path.split(".")
    if len(parts) > 1 and parts[1].isdigit():
        return ".".join(parts[:2])
    return parts[0]


def blocks_path(gm: fx.GraphModule) -> str | None:
    """Where the capture found the model's blocks ("model.layers"), or None in a graph ptc
    did not capture (a hand-built test graph: its units follow `group_key`'s other rule)."""
    try:
        return graph_record(gm).capture.blocks_path
    except KeyError:
        return None


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


def param_layout(gm: fx.GraphModule, shards: int, *, own_units: Collection[str] = (),
                 experts: ExpertParallelLayout | None = None) -> ParamLayout:
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
    blocks = blocks_path(gm)
    for node in gm.graph.nodes:
        params = used_params(gm, node)
        if not params:
            continue
        group = group_key(module_path(node) or params[0][0], blocks)
        for name, p in params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            key = name if name in own_units else \
                f"{group}.experts" if experts is not None and experts.is_expert(name) else group
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
        expert = experts is not None and experts.is_expert(unit_params[0])
        units.append(ShardUnit(name=key, params=tuple(unit_params), numel=offset,
                               shards=shards // experts.ep if expert else shards, expert=expert))
    return ParamLayout(units=tuple(units), params=slots)


def stage_param_layout(gm: fx.GraphModule, shards: int,
                       experts: ExpertParallelLayout | None = None) -> ParamLayout:
    """The parameter layout of a stage graph: its own parameters, each tied weight a unit of
    its own (so the copies on several stages have the same geometry and summable shards).

    Fixed once at the pipeline split's seam for every stage graph (an unsplit graph is
    one stage) and kept in the Decisions (`with_stage_layouts`): the zero and
    comm_overlap passes, the Program and the runtime read that one layout, so they agree.
    """
    shards_module = getattr(gm, "zero", None)
    if isinstance(shards_module, ZeroShards):  # lowered by the zero pass already: its layout
        return shards_module.layout
    return param_layout(gm, shards, own_units=tied_names(gm), experts=experts)


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
