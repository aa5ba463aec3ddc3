"""The checkpoint_layers pass: apply the plan's per-layer recompute policy to the graph."""

from __future__ import annotations

import logging
import operator

from torch import fx

from ptc.compiler.records.decisions import Decisions
from ptc.compiler.graph.lazy_code import graph_module
from ptc.compiler.graph.meta import copy_meta, get_info
from ptc.compiler.graph.recompute_regions import recompute_regions
from ptc.errors import CompileError
from ptc.plan import RECOMPUTE_MODULES, modules_policy, policy_modules
from ptc.passes.functional import functionalize
from ptc.ops.recompute import checkpoint_region, invoke_module

log = logging.getLogger("ptc.passes")

REGION_PREFIX = "ckpt_region_"
"""Attribute name prefix of the region GraphModules on the graph (readable names only: a
region is found by its `checkpoint_region` call, see `checkpoint_regions`)."""


def checkpoint_layers_pass(gm: fx.GraphModule, decisions: Decisions) -> fx.GraphModule:
    """Insert checkpoint_region calls so each layer's recompute policy reruns its regions.

    The memory model (ptc.compiler.memory) prices the plan's checkpoint policy;
    this pass makes the runtime match it. Which nodes a policy recomputes is
    `ptc.compiler.graph.recompute_regions.recompute_regions`' answer (a "full" layer is
    one region, a "selective" layer's attention core is, "ops" keeps the
    matmuls' outputs of one region, `modules(...)` recomputes the named
    modules). Each region's nodes move into one region GraphModule called
    through `ptc.ops.recompute.checkpoint_region`, so only its inputs (and,
    in a saving region, its matmuls' outputs) are kept and backward reruns
    the rest of its forward. Parameters the region reads stay get_attr nodes
    of the outer graph passed in as inputs, so later passes (ZeRO) still see
    and rewrite them; under ZeRO-3 a full region therefore keeps its layer's
    gathered weights until backward. Each layer's policy is the Decisions
    record's (checkpoint = "auto" is resolved per stage there, before any
    pass).
    """
    layers: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        info = get_info(node)
        if info is not None and info.layer is not None and node.op in ("call_module",
                                                                       "call_function",
                                                                       "call_method"):
            layers.setdefault(info.layer, []).append(node)
    counts: dict[str, int] = {}
    for layer, nodes in sorted(layers.items()):
        policy = decisions.policy(layer)
        regions = recompute_regions(nodes, policy, layer)
        for k, region in enumerate(regions):
            _gather(gm, list(region.nodes))
            _outline(gm, list(region.nodes), f"{REGION_PREFIX}{layer}_{region_tag(policy)}_{k}",
                     saving=region.saving)
        if regions:
            counts[policy] = counts.get(policy, 0) + 1
    if counts:
        gm.graph.lint()
        gm.recompile()
        if set(counts) <= {"full", "selective"}:
            log.info("checkpointed %d layers full, %d selective", counts.get("full", 0),
                     counts.get("selective", 0))
        else:
            log.info("checkpointed layers: %s",
                     ", ".join(f"{n} {p}" for p, n in sorted(counts.items())))
    return gm


def region_tag(policy: str) -> str:
    """The policy as a part of a region's attribute name: `modules(core_attn, mlp)` ->
    `modules__core_attn__mlp` (names must be identifiers)."""
    modules = policy_modules(policy)
    if modules is None or policy == "selective":
        return policy
    return "__".join(["modules", *(m for m in RECOMPUTE_MODULES if m in modules)])


def region_layer_policy(name: str) -> tuple[int, str]:
    """(layer, policy) of a region attribute named by this pass (`region_tag`)."""
    layer, rest = name.removeprefix(REGION_PREFIX).split("_", 1)
    tag = rest.rsplit("_", 1)[0]
    if tag.startswith("modules__"):
        return int(layer), modules_policy(tag.split("__")[1:])
    return int(layer), tag


def _gather(gm: fx.GraphModule, nodes: list[fx.Node]) -> None:
    """Reorder the graph so no other node lies between `nodes` (graph order): the nodes of
    the span that read the region move after it, the others before it."""
    members = set(nodes)
    order = list(gm.graph.nodes)
    span = order[order.index(nodes[0]):order.index(nodes[-1]) + 1]
    after: list[fx.Node] = []
    reading = set(members)
    for n in span:
        if n in members:
            if any(a in reading and a not in members for a in n.all_input_nodes):
                raise CompileError(f"cannot checkpoint {nodes[0].name}..{nodes[-1].name}: "
                                   f"{n.name} reads a node that reads the region")
        elif any(a in reading for a in n.all_input_nodes):
            after.append(n)
            reading.add(n)
    for n in span:
        if n not in members and n not in reading:
            nodes[0].prepend(n)
    anchor = nodes[-1]
    for n in after:
        anchor.append(n)
        anchor = n


def _has_params(gm: fx.GraphModule, node: fx.Node) -> bool:
    return any(True for _ in gm.get_submodule(str(node.target)).parameters())


def _invoked(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    """Replace `call_module m(x)` by `invoke_module(get_attr m, x)` (same name and metadata)."""
    with gm.graph.inserting_before(node):
        mod = gm.graph.get_attr(str(node.target))
        new = gm.graph.call_function(invoke_module, (mod, *node.args), dict(node.kwargs))
    copy_meta(node, mod, kind="other", shapes=(), dtypes=(), flops=0, params=0, param_bytes=0)
    copy_meta(node, new)
    node.replace_all_uses_with(new)
    name = node.name
    gm.graph.erase_node(node)
    new.name = name
    return new


def _outline(gm: fx.GraphModule, nodes: list[fx.Node], name: str, *, saving: bool = False
             ) -> None:
    """Move `nodes` (graph order) into a region GraphModule called via checkpoint_region;
    `saving`: the region keeps its matmuls' outputs (`ptc.compiler.graph.recompute_regions.Region`)."""
    # Leaf modules with parameters become functional ops on get_attr nodes of the outer graph.
    # Parameter-free ones (dropout, activations) are passed in as modules and invoked.
    nodes = [(functionalize(gm, n) if _has_params(gm, n) else _invoked(gm, n))
             if n.op == "call_module" else n for n in nodes]
    members = set(nodes)
    inputs: list[fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in members and a not in inputs:
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    if not outputs:
        return
    first = nodes[0]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for a in inputs:
        if order[a] > order[first]:
            if a.op == "get_attr":
                first.prepend(a)
                order = {n: i for i, n in enumerate(gm.graph.nodes)}
            else:
                raise CompileError(f"cannot checkpoint {first.name}..{nodes[-1].name}: "
                                   f"input {a.name} is computed inside the region's span")
    last = nodes[-1]
    for o in outputs:
        for u in o.users:
            if u not in members and order[u] < order[last]:
                raise CompileError(f"cannot checkpoint {first.name}..{last.name}: {u.name} "
                                   "reads the region before it ends")

    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        copy_meta(a, env[a], same_value=True)
    for n in nodes:
        env[n] = sub.node_copy(n, env.__getitem__)
    sub.output(tuple(env[o] for o in outputs) if len(outputs) > 1 else env[outputs[0]])
    region = graph_module(gm, sub, "CheckpointRegion")
    gm.add_submodule(name, region)

    with gm.graph.inserting_after(last):
        mod = gm.graph.get_attr(name)
    with gm.graph.inserting_after(mod):
        call = gm.graph.call_function(checkpoint_region, (mod, *inputs),
                                      {"save_matmuls": True} if saving else {})
    copy_meta(last, mod, kind="other", shapes=(), dtypes=(), flops=0, params=0, param_bytes=0)
    flops = sum(get_info(n).flops for n in nodes if get_info(n))
    if len(outputs) == 1:
        copy_meta(last, call, flops=flops)
    else:  # the call's value is the tuple of the outputs
        infos = [get_info(o) for o in outputs]
        copy_meta(last, call, flops=flops, shapes=tuple(i.shapes[0] for i in infos),
                  dtypes=tuple(i.dtypes[0] for i in infos))
    if len(outputs) == 1:
        outputs[0].replace_all_uses_with(call, delete_user_cb=lambda u: u not in members)
    else:
        prev = call
        for i, o in enumerate(outputs):
            with gm.graph.inserting_after(prev):
                item = gm.graph.call_function(operator.getitem, (call, i))
            copy_meta(o, item)
            o.replace_all_uses_with(
                item, delete_user_cb=lambda u, item=item: u not in members and u is not item)
            prev = item
    for n in reversed(nodes):
        gm.graph.erase_node(n)


def checkpoint_regions(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The region GraphModules `gm` calls through `checkpoint_region`, in graph order."""
    return [gm.get_submodule(str(node.args[0].target)) for node in gm.graph.nodes
            if node.op == "call_function" and node.target is checkpoint_region]
