"""The shard_params pass (ZeRO-3): parameters live as dp shards, gathered where used.

The pass rewrites a graph whose weights are module parameters into one
whose weights are values: every parameter use (a `call_module` Linear /
Embedding / LayerNorm / RMSNorm, or a `get_attr`) reads a view of a full
buffer that a `gather_params` node produced from the unit's shards
(`zero.shard_{i}`, see `ptc.compiler.graph.params.ZeroShards`). One gather per
*group* — a transformer layer, or another top-level module — sits before the
group's first use. A tied weight used by two groups (embed and head) is
gathered by each; both gathers' backwards add into the same shard gradient.

Each start sits right before its wait: when to issue it (a layer early, so
the weights travel while the previous layer computes) and which small
gathers to merge is the comm_overlap pass's decision
(`ptc.passes.overlap_collectives`); the runtime's session prefetches in backward
(see `ptc.ops.zero3`).
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
from torch import fx

from ptc.compiler.graph.meta import copy_meta, get_info
from ptc.compiler.graph.nodes import module_path
from ptc.compiler.records.decisions import Decisions
from ptc.compiler.graph.stage_graphs import stage_info
from ptc.compiler.records.params import COMPUTE_DTYPES, ParamLayout, ParamSlot
from ptc.compiler.graph.params import ZeroShards, blocks_path, group_key, used_params
from ptc.errors import CompileError
from ptc.passes.functional import functional_op, replace_call
from ptc.ops.collectives import gather_params, gather_params_start

log = logging.getLogger("ptc.passes.shard_params")

SHARDS_ATTR = "zero"


def shard_params_pass(gm: fx.GraphModule, decisions: Decisions) -> fx.GraphModule:
    """Insert gather_params before each layer's first use and keep only parameter shards.

    ZeRO-3 stores 1/dp of every parameter per rank; the graph itself shows
    where full weights are materialised, so memory and overlap are visible
    to later passes and to `ptc inspect`. Runs only when `parallel.zero` is 3,
    on a stage graph, whose parameter layout the pipeline split fixed.
    """
    plan = decisions.plan
    if plan.parallel.zero < 3:
        return gm
    if hasattr(gm, SHARDS_ATTR):
        raise CompileError(f"zero: the model already has an attribute {SHARDS_ATTR!r}")
    dtype = COMPUTE_DTYPES[plan.train.compute_dtype]
    layout = decisions.stage_layout(stage_info(gm).index)
    slots = _slots_by_param(gm, layout)
    gm.add_submodule(SHARDS_ATTR, ZeroShards(layout))
    gathers = [_insert_gather(gm, uses, slots, dtype, expert)
               for uses in _uses_by_group(gm).values() for expert in (False, True)
               if any(layout.units[slots[id(p)].unit].expert == expert
                      for _, params in uses for _, p in params)]
    _drop_params(gm, layout)
    gm.delete_all_unused_submodules()
    gm.graph.lint()
    gm.recompile()
    log.info("inserted %d gather_params", len(gathers))
    return gm


def _slots_by_param(gm: fx.GraphModule, layout: ParamLayout) -> dict[int, ParamSlot]:
    by_alias = {alias: slot for slot in layout.params.values() for alias in slot.aliases}
    return {id(p): by_alias[name] for name, p in gm.named_parameters(remove_duplicate=False)}


def _uses_by_group(gm: fx.GraphModule) -> dict[str, list[tuple[fx.Node, list]]]:
    groups: dict[str, list[tuple[fx.Node, list]]] = {}
    blocks = blocks_path(gm)
    for node in list(gm.graph.nodes):
        params = used_params(gm, node)
        if params:
            key = group_key(module_path(node) or params[0][0], blocks)
            groups.setdefault(key, []).append((node, params))
    return groups


def _meta(src: fx.Node, dst: fx.Node, **changes: Any) -> None:
    # Created nodes stand for `src` (provenance, layer); they compute nothing themselves.
    if get_info(src) is None:
        copy_meta(src, dst)
    else:
        copy_meta(src, dst, **changes)


def _insert_gather(gm: fx.GraphModule, uses: list[tuple[fx.Node, list]],
                   slots: dict[int, ParamSlot], dtype: torch.dtype,
                   expert: bool) -> tuple[fx.Node, ...]:
    """Insert shard reads, start, wait and weight views before the group's first use of
    its expert units (`expert`, gathered over the ranks holding the same experts, "edp")
    or of its other units (over dp)."""
    layout = getattr(gm, SHARDS_ATTR).layout
    uses = [(node, [(n, p) for n, p in params if layout.units[slots[id(p)].unit].expert == expert])
            for node, params in uses]
    uses = [(node, params) for node, params in uses if params]
    graph, first = gm.graph, uses[0][0]
    units = sorted({slots[id(p)].unit for _, params in uses for _, p in params})
    free = dict(flops=0, params=0, param_bytes=0)
    views: dict[str, fx.Node] = {}
    with graph.inserting_before(first):
        shards = tuple(graph.get_attr(f"{SHARDS_ATTR}.shard_{u}") for u in units)
        start = graph.call_function(gather_params_start, (shards,),
                                    {"axis": "edp" if expert else "dp", "dtype": dtype})
        wait = graph.call_function(gather_params, (start, shards))
        shard_params = [gm.get_parameter(f"{SHARDS_ATTR}.shard_{u}") for u in units]
        full = tuple((layout.units[u].padded_numel,) for u in units)
        for node, param in zip(shards, shard_params):
            _meta(first, node, kind="other", shapes=(tuple(param.shape),), dtypes=(param.dtype,),
                  **free)
        _meta(first, start, kind="other", shapes=(), dtypes=(), **free)  # a handle
        _meta(first, wait, kind="other", shapes=full, dtypes=(dtype,) * len(units), **free)
        flats = {}
        for i, u in enumerate(units):
            flats[u] = graph.call_function(operator.getitem, (wait, i))
            _meta(first, flats[u], kind="view", shapes=(full[i],), dtypes=(dtype,), **free)
        for node, params in uses:
            for _, p in params:
                slot = slots[id(p)]
                if slot.name in views:
                    continue
                piece = graph.call_function(operator.getitem, (
                    flats[slot.unit], slice(slot.offset, slot.offset + slot.numel)))
                view = graph.create_node("call_method", "view", (piece, slot.shape),
                                         name=slot.name.replace(".", "_"))
                _meta(node, piece, kind="view", shapes=((slot.numel,),), dtypes=(dtype,), **free)
                _meta(node, view, kind="view", shapes=(slot.shape,), dtypes=(dtype,), **free)
                views[slot.name] = view
    for node, params in uses:
        _rewrite(gm, node, {name: views[slots[id(p)].name] for name, p in params})
    return (*shards, start, wait)


def _rewrite(gm: fx.GraphModule, node: fx.Node, weights: dict[str, fx.Node]) -> None:
    """Make `node` read its weights from `weights` (name in gm -> view node)."""
    if node.op == "get_attr":
        node.replace_all_uses_with(weights[str(node.target)])
        gm.graph.erase_node(node)
        return
    module = gm.get_submodule(str(node.target))
    fn, args = functional_op(node, module, lambda leaf: weights[f"{node.target}.{leaf}"])
    replace_call(gm, node, fn, args)


def _drop_params(gm: fx.GraphModule, layout: ParamLayout) -> None:
    for slot in layout.params.values():
        for alias in slot.aliases:
            owner, _, leaf = alias.rpartition(".")
            module = gm.get_submodule(owner) if owner else gm
            module._parameters.pop(leaf, None)
