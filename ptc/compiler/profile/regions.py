"""The regions of a one-layer graph (pre, layer, post) and what crosses its boundaries:
where a profile's quantities are measured."""

from __future__ import annotations

import torch
import torch.fx

from ptc.compiler.graph.meta import get_info


def node_regions(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Node name -> "pre" / "layer" (layer 0) / "later" (layers after it) / "post"."""
    region, seen_layer = {}, False
    for n in gm.graph.nodes:
        info = get_info(n)
        if n.op == "get_attr":  # where its readers are (the export door puts them first)
            continue
        if info is not None and info.layer is not None:
            region[n.name], seen_layer = "layer" if info.layer == 0 else "later", True
        else:
            region[n.name] = "post" if seen_layer else "pre"
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            users = [region[u.name] for u in n.users if u.name in region]
            region[n.name] = users[0] if users else "pre"
    return region


def meta_inputs(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    tensors = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            info = get_info(n)
            tensors.append(torch.zeros(info.shapes[0], dtype=info.dtypes[0], device="meta"))
    return tensors


def layer_nodes(gm: torch.fx.GraphModule, region: dict[str, str]) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if region[n.name] == "layer"
            and n.op in ("call_module", "call_function", "call_method")]


def boundary_nodes(gm: torch.fx.GraphModule, region: dict[str, str]) -> set[str]:
    """Nodes whose outputs cross layer 0's boundaries, as a fully recomputed layer's
    checkpoint holds them: what layer 0 reads from before it (its input) and its nodes
    read after it (its output, the next layer's input). Model state is not among them."""
    crossing = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            continue
        inside = region[n.name] == "layer"
        if any((region[u.name] == "layer") != inside for u in n.users):
            crossing.add(n.name)
    return crossing


def placeholder_names(gm: torch.fx.GraphModule) -> set[str]:
    return {n.name for n in gm.graph.nodes if n.op == "placeholder"}
