"""The expert_parallel pass: spread each layer's routed experts over the ep ranks.

Expert parallelism (`parallel.ep`) folds ep ranks out of the dp·cp ranks, which
hold other tokens of the same weights (Megatron-Core's parallel folding): ep
rank j keeps experts j·E/ep .. (j+1)·E/ep - 1 of every mixture-of-experts
layer, and the tokens routed to them come to it. For every expert block the
graph holds (`ptc.compiler.graph.moe_structure`: the grouped products that
share one group-offsets tensor), the pass:

- cuts each expert stack to the rank's E/ep experts (dim 0);
- puts `ep_dispatch` before the first grouped product: the rows, grouped by
  expert, go to the ranks holding their experts by an all-to-all of uneven
  splits, and arrive grouped by local expert with their own offsets (per-row
  inputs of the body, a gathered per-expert bias, travel with them);
- puts `ep_combine` after the last: the experts' output rows go back to the
  ranks and places they came from.

Routing — the router, its top-k, its load-balancing loss — runs untouched on
each rank's own tokens, before the dispatch: it computes exactly what the
module computes. The graph's shapes stay those of a balanced routing (each
rank receives as many rows as it sends); the runtime's are what the router chose.
"""

from __future__ import annotations

import dataclasses
import logging
import operator

import torch
from torch import fx

from ptc.compiler.graph.meta import KEY, copy_meta, get_info, update_graph_record
from ptc.compiler.graph.moe_structure import ExpertBlock, find_expert_blocks
from ptc.compiler.graph.nodes import walk
from ptc.compiler.records.decisions import Decisions
from ptc.compiler.records.ep_layout import EXPERT, ExpertParallelLayout
from ptc.compiler.records.tp_layout import ParamShard
from ptc.errors import CompileError
from ptc.ops.expert_parallel import ep_combine, ep_dispatch
from ptc.passes.local_params import param_aliases, set_local_param

log = logging.getLogger("ptc.passes.shard_experts")

EP = "ep"
"""The mesh axis of expert parallelism."""
_FREE = dict(flops=0, params=0, param_bytes=0)


def shard_experts_pass(gm: fx.GraphModule, decisions: Decisions) -> fx.GraphModule:
    """Insert ep_dispatch / ep_combine around each layer's experts and keep 1/ep of them.

    Each rank then holds and computes 1/ep of the routed experts, at the cost of
    two all-to-alls of the routed rows per layer in forward and two in
    backward. Runs when `parallel.ep` > 1; raises CompileError when the model
    has no routed experts, when ep does not divide a layer's experts, or when
    the experts' rows cannot be followed (`moe_structure`).
    """
    ep = decisions.plan.parallel.ep
    if ep == 1:
        return gm
    blocks = find_expert_blocks(gm)
    if not blocks:
        raise CompileError(f"parallel.ep = {ep}, but the model has no routed experts: no "
                           "grouped product of token rows with a stack of expert weights "
                           "(experts kept as a list of modules, or looped over one by one — "
                           "transformers' experts_implementation = \"eager\" — are not "
                           "sharded; parallel.ep = 1 trains it as it is)")
    aliases = param_aliases(gm)
    specs: dict[str, ParamShard] = {}
    layers: dict[int, int] = {}
    for block in blocks:
        if block.experts % ep:
            layer = get_info(block.output).layer
            raise CompileError(f"parallel.ep = {ep} does not divide the {block.experts} routed "
                               f"experts of layer {layer}; valid: a divisor of {block.experts}")
        layers[get_info(block.output).layer] = block.experts
        for stack in block.stacks:
            shape = tuple(gm.get_parameter(stack).shape)
            spec = ParamShard(style=EXPERT, dim=0, segments=(shape[0],), full_shape=shape)
            set_local_param(gm, aliases[stack], spec.local_shape(ep))
            specs.update({alias: spec for alias in aliases[stack]})
            _local_weight_meta(gm, stack, block, ep)
        _exchange(gm, block, ep)
    update_graph_record(gm, expert_parallel=ExpertParallelLayout(ep=ep, params=specs,
                                                                 layers=layers))
    gm.graph.lint()
    gm.recompile()
    log.info("inserted %d ep_dispatch, %d ep_combine; %d expert stacks split %d ways",
             len(blocks), len(blocks), len({s for b in blocks for s in b.stacks}), ep)
    return gm


def _exchange(gm: fx.GraphModule, block: ExpertBlock, ep: int) -> None:
    """Dispatch the block's rows (and per-row inputs) before its first product; combine the
    last product's rows after it."""
    graph, first, last = gm.graph, block.products[0], block.output
    order = {node: i for i, node in enumerate(graph.nodes)}
    late = [n for n in (block.rows, block.offsets, *block.row_inputs) if order[n] > order[first]]
    if late:
        raise CompileError(f"expert parallelism: {late[0].name} is computed after the experts' "
                           f"first grouped product {first.name}; the rows cannot be sent with it")
    with graph.inserting_before(first):
        dispatch = graph.call_function(ep_dispatch, (block.rows, block.offsets,
                                                     *block.row_inputs),
                                       {"experts": block.experts, "axis": EP})
        parts = [graph.call_function(operator.getitem, (dispatch, i))
                 for i in range(3 + len(block.row_inputs))]
    copy_meta(first, dispatch, kind="other", **_FREE, shapes=(), dtypes=())
    x_local, offsets_local, route, *rows_local = parts
    # Shapes as a balanced routing gives them: as many rows received as sent.
    for part, source in zip((x_local, *rows_local), (block.rows, *block.row_inputs)):
        copy_meta(first, part, kind="view", **_FREE, shapes=get_info(source).shapes,
                  dtypes=get_info(source).dtypes)
    copy_meta(first, offsets_local, kind="view", **_FREE, shapes=((block.experts // ep,),),
              dtypes=get_info(block.offsets).dtypes)
    copy_meta(first, route, kind="view", **_FREE, shapes=((ep, block.experts),),
              dtypes=(torch.int64,))
    swaps = {block.rows: x_local, block.offsets: offsets_local,
             **dict(zip(block.row_inputs, rows_local))}
    for node in block.body:
        for old, new in swaps.items():
            if old in node.all_input_nodes:
                node.replace_input_with(old, new)
    with graph.inserting_after(last):
        combine = graph.call_function(ep_combine, (last, route), {"axis": EP})
    copy_meta(last, combine, kind="other", **_FREE)
    last.replace_all_uses_with(combine, delete_user_cb=lambda user: user is not combine)


def _local_weight_meta(gm: fx.GraphModule, stack: str, block: ExpertBlock, ep: int) -> None:
    """Record the rank's E/ep experts in the shapes of the stack's nodes up to its products
    (the parameter read, its transposes and casts)."""
    reads = [n for n in gm.graph.nodes if n.op == "get_attr" and str(n.target) == stack]
    stop = set(block.products)
    for node in walk(reads, lambda n: [u for u in n.users if u not in stop]):
        info = get_info(node)
        if info is None or not info.shapes or not info.shapes[0] or \
                info.shapes[0][0] != block.experts:
            continue
        shapes = tuple((s[0] // ep, *s[1:]) if s and s[0] == block.experts else s
                       for s in info.shapes)
        node.meta[KEY] = dataclasses.replace(info, shapes=shapes, params=info.params // ep,
                                             param_bytes=info.param_bytes // ep)
