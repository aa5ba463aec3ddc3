"""A stage's backward in two parts, as zero-bubble schedules run it: I, the gradients of
the stage's inputs (what the previous stage waits for), then W, the gradients of its
weights (what nothing waits for), later, in a bubble.

I runs autograd from the stage's outputs to its inputs alone and keeps the graph:
autograd then computes no weight gradient, since a node computes only the gradients
that lead to a requested input. On the way, I keeps the gradient that reaches each
*branch node*: a node on the way to the inputs that also leads, off that way, to a
weight (the backward of a matmul whose other operand is a weight, of a norm with
an affine weight). W starts autograd again at those nodes with those gradients and
asks for the weights alone: it re-runs the branch nodes for their weight side and
the nodes between them and the weights, nothing of the input side.

The branch nodes are grouped by the weights they reach (a weight read twice joins its
readers in one group), and W runs one autograd call per group, asking for that group's
weights only: a call from one branch node then never walks down the input side to the
next one. Where a group's branch node lies below another of the group, it would get
its gradient twice in that call (seeded, and again from above): a hook holds it at
the gradient it had in I.

Weights get their gradients through autograd's accumulation, so the hooks on it (the
gradient reducer's) run in W as they run in a whole backward.

A checkpointed region (`ptc.ops.recompute`) read by both I and W is recomputed once:
what the nodes W runs again (the branch nodes, and the input side between two branch
nodes of one group) read of it in I stays for W; the rest is dropped as it is read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from ptc.ops.recompute import keeping_reads


@dataclass(eq=False)
class WeightBackward:
    """What W of one stage micro-batch runs: `run()` accumulates the weights' gradients."""

    run: Callable[[], None]


def input_backward(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None,
                   inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]
                   ) -> tuple[list[torch.Tensor | None], WeightBackward]:
    """I: the gradients of `inputs` from `outputs` (seeded with `grads`; None: ones, for a
    loss), and the W that gives `weights` theirs. With no input needing a gradient (the
    first stage), I computes nothing and W is the whole backward; with no output (nothing
    before them trains), neither computes anything."""
    if not outputs:
        return [None] * len(inputs), WeightBackward(lambda: None)
    weights = [w for w in weights if w.requires_grad]
    wanted = [t for t in inputs if t.requires_grad]
    if not wanted:
        return [None] * len(inputs), WeightBackward(
            lambda: torch.autograd.backward(list(outputs), grads))
    input_nodes = {get_gradient_edge(t).node for t in wanted}
    weight_nodes = {get_gradient_edge(w).node: w for w in weights}
    children = _below(t.grad_fn for t in outputs)
    input_side = _leading_to(input_nodes, children)
    groups = _branch_groups(children, input_side, weight_nodes)
    seeds: dict[Node, tuple] = {}
    hooks = [node.register_prehook(_keeper(seeds, node)) for nodes, _ in groups for node in nodes]
    for node in _run_again(groups, children, input_side, weight_nodes):
        hooks += [node.register_prehook(_keeping), node.register_hook(_reads_done)]
    try:
        got = torch.autograd.grad(list(outputs), wanted, grads, retain_graph=True,
                                  allow_unused=True)
    finally:
        for hook in hooks:
            hook.remove()
    by_input = dict(zip(map(id, wanted), got))
    return ([by_input.get(id(t)) for t in inputs],
            WeightBackward(lambda: _weight_backward(groups, seeds)))


def _below(roots) -> dict[Node, list[Node]]:
    """Every node under `roots` with the nodes its backward hands gradients to."""
    children: dict[Node, list[Node]] = {}
    stack = [node for node in roots if node is not None]
    while stack:
        node = stack.pop()
        if node in children:
            continue
        children[node] = [child for child, _ in node.next_functions if child is not None]
        stack.extend(children[node])
    return children


def _leading_to(targets: set[Node], children: dict[Node, list[Node]]) -> set[Node]:
    """The nodes from which a node of `targets` is reached (the targets included)."""
    parents: dict[Node, list[Node]] = {}
    for node, below in children.items():
        for child in below:
            parents.setdefault(child, []).append(node)
    seen, stack = set(targets), list(targets)
    while stack:
        for parent in parents.get(stack.pop(), ()):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def _branch_groups(children: dict[Node, list[Node]], input_side: set[Node],
                   weight_nodes: dict[Node, torch.Tensor]
                   ) -> list[tuple[list[Node], list[torch.Tensor]]]:
    """(branch nodes, the weights they reach off the input side), grouped so that no two
    groups share a weight."""
    reach: dict[Node, set[Node]] = {}  # off the input side: node -> weight nodes below it

    def weights_below(node: Node) -> set[Node]:
        if node not in reach:
            reach[node] = set()  # autograd graphs are acyclic: a guard, not a cycle cut
            found = {node} if node in weight_nodes else set()
            for child in children.get(node, ()):
                if child not in input_side:
                    found |= weights_below(child)
            reach[node] = found
        return reach[node]

    branches = [(node, found) for node in children if node in input_side
                for found in [set().union(*(weights_below(c) for c in children[node]
                                            if c not in input_side))] if found]
    joined: dict[Node, Node] = {}  # union-find over the weight nodes

    def root(weight: Node) -> Node:
        while joined.get(weight, weight) is not weight:
            weight = joined[weight]
        return weight

    for _, found in branches:
        first, *rest = found
        for weight in rest:
            joined[root(weight)] = root(first)
    groups: dict[Node, tuple[list[Node], set[Node]]] = {}
    for node, found in branches:
        nodes, reached = groups.setdefault(root(next(iter(found))), ([], set()))
        nodes.append(node)
        reached |= found
    return [(nodes, [weight_nodes[w] for w in reached]) for nodes, reached in groups.values()]


def _keeper(seeds: dict[Node, tuple], node: Node):
    """A pre-hook that keeps the gradients reaching `node`."""
    def keep(grad_outputs):
        seeds[node] = grad_outputs
    return keep


def _run_again(groups: list[tuple[list[Node], list[torch.Tensor]]],
               children: dict[Node, list[Node]], input_side: set[Node],
               weight_nodes: dict[Node, torch.Tensor]) -> set[Node]:
    """The nodes I runs that W runs again: those on a way from a group's branch nodes to its
    weights (the branch nodes, and where one branch node of a group lies below another,
    the input side between them)."""
    node_of = {id(w): node for node, w in weight_nodes.items()}
    again: set[Node] = set()
    for nodes, weights in groups:
        leads = _leading_to({node_of[id(w)] for w in weights}, children)
        stack = [node for node in nodes if node in leads]
        while stack:
            node = stack.pop()
            if node in again:
                continue
            again.add(node)
            stack.extend(child for child in children.get(node, ()) if child in leads)
    return again & input_side


def _keeping(grad_outputs) -> None:
    """Pre-hook of a node W runs again: what it reads of a recomputed region stays for W
    (`ptc.ops.recompute.keeping_reads`)."""
    keeping_reads(True)


def _reads_done(grad_inputs, grad_outputs) -> None:
    """Its post-hook: what later nodes read is read once."""
    keeping_reads(False)


def _weight_backward(groups: list[tuple[list[Node], list[torch.Tensor]]],
                     seeds: dict[Node, tuple]) -> None:
    """W: per group, autograd from its branch nodes (seeded with what reached them in I)
    to its weights."""
    for nodes, weights in groups:
        edges, grads = [], []
        for node in nodes:
            for index, grad in enumerate(seeds.get(node, ())):
                if grad is not None:
                    edges.append(GradientEdge(node, index))
                    grads.append(grad)
        if not edges:
            continue
        holds = [node.register_prehook(lambda _, kept=seeds[node]: kept)
                 for node in nodes if node in seeds] if len(nodes) > 1 else []
        try:
            torch.autograd.backward(edges, grads, inputs=weights)
        finally:
            for hold in holds:
                hold.remove()
