"""What each recompute policy recomputes in a layer: its regions, read off the graph.

One answer serves the activation_checkpoint pass (which outlines each region
and calls it through `ptc.ops.recompute.checkpoint_region`) and the memory
profile (`ptc.compiler.profile`, which prices what the regions keep), so the
prediction and the runtime cannot disagree about what a policy means.

Terms:
- a *region* is a set of a layer's nodes run under one checkpoint: its
  inputs are kept, its intermediate activations are not, backward reruns it;
- a *saving* region also keeps the outputs of its matmuls — linears,
  matmuls of activations, the fused attention kernel (flash: output and
  log-sum-exp) — as torch's selective activation checkpointing does, so
  backward reruns only the ops between them;
- a layer's *modules*: `core_attn` (the attention core: scores, softmax,
  dropout, probabilities @ values; or the fused attention kernel), `mlp`
  (from the MLP's input linears to its output linear, both included), `norm`
  (each normalisation), `act` (each activation function).

Policies:
- "full": the layer is one region;
- "selective" (= modules(core_attn)): each attention core is a region; the
  core's output stays saved by the output projection that reads it;
- "ops": the layer is one saving region: every matmul's output is kept, every
  other op is recomputed;
- modules(...): the union of the named modules. core_attn and mlp are
  recomputed whole, their outputs kept by whoever saves them. A norm or an
  activation function feeds matmuls that save its output, so recomputing it
  alone would free nothing: its region extends through the ops reading it up
  to the next matmuls, whose outputs it keeps (a saving region; Megatron-LM
  frees the output of its recomputed layernorm and activation the same way).
  Modules that share nodes merge into one region (norm with mlp: the MLP's
  input linears are then recomputed too, no longer kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

from torch import fx

from ptc.compiler.graph.meta import get_info
from ptc.compiler.graph.nodes import attention_parts, classify, is_norm, module_path
from ptc.errors import CompileError
from ptc.plan import RECOMPUTE_MODULES, modules_policy, policy_modules

EXTRA_POLICIES = ("ops",) + tuple(
    p for k in range(1, len(RECOMPUTE_MODULES) + 1)
    for p in (modules_policy(c) for c in combinations(RECOMPUTE_MODULES, k)) if p != "selective")
"""Policies beyond none / selective / full: "ops" and every `modules(...)` set."""
LAYER_POLICIES = ("none", "selective", "full") + EXTRA_POLICIES
"""Every recompute policy a layer can take."""

MATMUL_KINDS = frozenset({"linear", "matmul", "attention"})
"""Node kinds (`nodes.classify`) whose outputs a saving region keeps."""


@dataclass(frozen=True, slots=True)
class Region:
    """Nodes of one layer recomputed under one checkpoint."""

    nodes: tuple[fx.Node, ...]
    """The region's nodes, in graph order."""
    saving: bool
    """Keep the outputs of its matmuls (`MATMUL_KINDS`) rather than recompute them."""


def is_matmul(node: fx.Node) -> bool:
    """Whether a saving region keeps this node's output (a linear, matmul or attention)."""
    return node.op in ("call_module", "call_function", "call_method") \
        and classify(node) in MATMUL_KINDS


def recompute_regions(nodes: list[fx.Node], policy: str, layer: int) -> list[Region]:
    """The regions `policy` recomputes among one layer's nodes (graph order); [] for none.

    Raises a CompileError naming the layer when a module the policy names is
    not in it: a policy never silently recomputes nothing.
    """
    if policy == "none" or not nodes:
        return []
    if policy == "full":
        return [Region(tuple(nodes), False)]
    if policy == "ops":
        return [Region(tuple(nodes), True)]
    if policy == "selective":
        cores = attention_cores(nodes)
        if not cores:
            raise CompileError(f"checkpoint = selective: no attention found in layer {layer}")
        return [Region(tuple(core), False) for core in cores]
    modules = policy_modules(policy)
    if modules is None:
        raise CompileError(f"unknown recompute policy {policy!r} for layer {layer}")
    groups: list[tuple[set[fx.Node], set[fx.Node]]] = []  # (recomputed, kept matmuls)
    finders = {"core_attn": lambda: [(set(c), set()) for c in attention_cores(nodes)],
               "mlp": lambda: [(m, set()) for m in _mlps(nodes)],
               "norm": lambda: [_up_to_matmuls(n, nodes) for n in _norms(nodes)],
               "act": lambda: [_up_to_matmuls({n}, nodes) for n in nodes
                               if classify(n) == "activation"]}
    for name in sorted(modules, key=list(finders).index):
        found = finders[name]()
        if not found:
            what = {"core_attn": "attention core", "mlp": "MLP (linear, activation, linear)",
                    "norm": "normalisation", "act": "activation function"}[name]
            raise CompileError(f"checkpoint = {policy}: layer {layer} has no {what} "
                               f"({name}) to recompute")
        groups.extend(found)
    merged: list[tuple[set[fx.Node], set[fx.Node]]] = []
    for recomputed, kept in groups:
        members = recomputed | kept
        for other in [g for g in merged if (g[0] | g[1]) & members]:
            merged.remove(other)
            recomputed, kept = recomputed | other[0], kept | other[1]
            members = recomputed | kept
        merged.append((recomputed, kept))
    order = {n: i for i, n in enumerate(nodes)}
    regions = []
    for recomputed, kept in sorted(merged, key=lambda g: min(order[n] for n in g[0] | g[1])):
        kept -= recomputed
        members = sorted(recomputed | kept, key=order.__getitem__)
        saving = bool(kept)
        if saving and any(is_matmul(n) and n not in kept for n in members):
            raise CompileError(f"checkpoint = {policy}: layer {layer} mixes matmuls to keep "
                               f"and to recompute in one region ({members[0].name}.."
                               f"{members[-1].name})")
        regions.append(Region(tuple(members), saving))
    return regions


def attention_cores(nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """The attention cores among a layer's nodes, each as its nodes in graph order: the
    fused kernel, or everything between the scores matmul and the output matmul."""
    members = set(nodes)
    cores = []
    for node in nodes:
        parts = attention_parts(node)
        if parts is None:
            continue
        if parts.fused:
            cores.append([node])
            continue
        scores = _scores_node(parts)
        core = _reach(scores, members, lambda n: n.users) & _reach(
            node, members, lambda n: n.all_input_nodes)
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


def _mlps(nodes: list[fx.Node]) -> list[set[fx.Node]]:
    """Each MLP of the layer: from the linears feeding its activation function (and the
    gate's partner) to the linear after it, both ends included."""
    members = set(nodes)
    found: list[set[fx.Node]] = []
    for act in (n for n in nodes if classify(n) == "activation"):
        if any(act in mlp for mlp in found):
            continue
        out = _first_linear(act, members, lambda n: n.users)
        if out is None:
            continue
        inputs: set[fx.Node] = set()
        todo, seen = list(out.all_input_nodes), set()
        while todo:  # back from the output linear to the linears that feed it
            n = todo.pop()
            if n in seen or n not in members:
                continue
            seen.add(n)
            if classify(n) == "linear":
                inputs.add(n)
            else:
                todo.extend(n.all_input_nodes)
        if not inputs:
            continue
        down = set().union(*(_reach(i, members, lambda n: n.users) for i in inputs))
        found.append(down & _reach(out, members, lambda n: n.all_input_nodes))
    return found


def _first_linear(start: fx.Node, members: set[fx.Node], step) -> fx.Node | None:
    """The first linear reached from `start` (breadth first) by `step`, within members."""
    todo, seen = list(step(start)), set()
    while todo:
        n = todo.pop(0)
        if n in seen or n not in members:
            continue
        seen.add(n)
        if classify(n) == "linear":
            return n
        todo.extend(step(n))
    return None


def _floating(node: fx.Node) -> bool:
    info = get_info(node)
    return info is not None and bool(info.dtypes) and info.dtypes[0].is_floating_point


def _norms(nodes: list[fx.Node]) -> list[set[fx.Node]]:
    """Each normalisation of the layer, as its nodes (one for a norm op or module; all the
    nodes of a hand-written norm module)."""
    norms = []
    for n in nodes:
        path = is_norm(n)
        if path is None:
            continue
        inside = {m for m in nodes if n.op != "call_module" and module_path(m) == path
                  and m.op != "call_module"} if n.op != "call_module" else set()
        norms.append(inside | {n})
    return norms


def _up_to_matmuls(start: set[fx.Node], nodes: list[fx.Node]) -> tuple[set[fx.Node],
                                                                       set[fx.Node]]:
    """(recomputed, kept): `start` and the ops reading its outputs, on to the matmuls that
    read them, whose outputs are kept; within the layer."""
    members = set(nodes)
    recomputed, kept = set(start), set()
    todo = [u for n in start for u in n.users]
    while todo:
        n = todo.pop()
        if n not in members or n in recomputed or n in kept or not _floating(n):
            continue  # shapes read off a tensor (x.shape, size) are no reader of its values
        if is_matmul(n):
            kept.add(n)
        else:
            recomputed.add(n)
            todo.extend(n.users)
    return recomputed, kept
