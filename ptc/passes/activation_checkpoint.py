"""Activation checkpointing: apply the plan's per-layer recompute policy to the graph."""

from __future__ import annotations

import logging
import operator

from torch import fx

from ptc.compiler.decisions import Decisions
from ptc.compiler.meta import copy_meta, get_info
from ptc.compiler.nodes import attention_parts
from ptc.errors import CompileError
from ptc.passes.codegen import recompile
from ptc.passes.functional import functionalize
from ptc.ops.recompute import checkpoint_region, invoke_module

log = logging.getLogger("ptc.passes")

REGION_PREFIX = "ckpt_region_"
"""Attribute name prefix of the region GraphModules on the graph (readable names only: a
region is found by its `checkpoint_region` call, see `checkpoint_regions`)."""


def checkpoint_layers_pass(gm: fx.GraphModule, decisions: Decisions) -> fx.GraphModule:
    """Insert checkpoint_region calls so layers (or their attention cores) recompute in backward.

    The memory model (ptc.compiler.memory) prices the plan's checkpoint policy;
    this pass makes the runtime match it. A "full" layer's nodes move into
    one region GraphModule, a "selective" layer's attention core (scores,
    softmax, dropout, probabilities @ values; or the fused SDPA) does; each
    region is called through `ptc.ops.recompute.checkpoint_region`, so
    only its inputs are kept and backward reruns its forward. Parameters the
    region reads stay get_attr nodes of the outer graph passed in as inputs,
    so later passes (ZeRO) still see and rewrite them; under ZeRO-3 a full
    region therefore keeps its layer's gathered weights until backward.
    Each layer's policy is the Decisions record's (checkpoint = "auto" is
    resolved per stage there, before any pass).
    """
    layers: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        info = get_info(node)
        if info is not None and info.layer is not None and node.op in ("call_module",
                                                                       "call_function",
                                                                       "call_method"):
            layers.setdefault(info.layer, []).append(node)
    counts = {"full": 0, "selective": 0}
    for layer, nodes in sorted(layers.items()):
        policy = decisions.policy(layer)
        if policy == "full":
            regions = [nodes]
        elif policy == "selective":
            regions = _attention_cores(nodes)
            if not regions:
                raise CompileError(f"checkpoint = selective: no attention found in layer {layer}")
        else:
            continue
        for k, region in enumerate(regions):
            _outline(gm, region, f"{REGION_PREFIX}{layer}_{policy}_{k}")
        counts[policy] += 1
    if counts["full"] or counts["selective"]:
        gm.graph.lint()
        recompile(gm)
        log.info("checkpointed %d layers full, %d selective", counts["full"], counts["selective"])
    return gm


def _attention_cores(nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """The attention cores among a layer's nodes, each as its nodes in graph order."""
    members = set(nodes)
    cores = []
    for node in nodes:
        parts = attention_parts(node)
        if parts is None:
            continue
        if parts.fused:
            cores.append([node])
            continue
        # Everything between the scores matmul and the output matmul.
        scores = _scores_node(parts)
        down = _reach(scores, members, lambda n: n.users)
        up = _reach(node, members, lambda n: n.all_input_nodes)
        core = down & up
        cores.append([n for n in nodes if n in core])
    return cores


def _scores_node(parts) -> fx.Node:
    """The q @ k^T matmul node of a written-out attention."""
    q = parts.q
    for user in q.users:
        if parts.k in user.all_input_nodes:
            return user
    # q or k went through a view on the way: search from the output back.
    todo, seen = [parts.out], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if q in n.all_input_nodes and parts.k in n.all_input_nodes:
            return n
        todo.extend(n.all_input_nodes)
    raise CompileError(f"cannot find the scores of attention {parts.out.name}")


def _reach(node: fx.Node, members: set[fx.Node], step) -> set[fx.Node]:
    """The members reachable from `node` (itself included) by repeatedly taking `step(n)`."""
    out, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in out or n not in members:
            continue
        out.add(n)
        todo.extend(step(n))
    return out


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


def _outline(gm: fx.GraphModule, nodes: list[fx.Node], name: str) -> None:
    """Move `nodes` (graph order) into a region GraphModule called via checkpoint_region."""
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
    region = fx.GraphModule(gm, sub, "CheckpointRegion")
    gm.add_submodule(name, region)

    with gm.graph.inserting_after(last):
        mod = gm.graph.get_attr(name)
    with gm.graph.inserting_after(mod):
        call = gm.graph.call_function(checkpoint_region, (mod, *inputs))
    copy_meta(last, mod, kind="other", shapes=(), dtypes=(), flops=0, params=0, param_bytes=0)
    copy_meta(last, call, flops=sum(get_info(n).flops for n in nodes if get_info(n)))
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
