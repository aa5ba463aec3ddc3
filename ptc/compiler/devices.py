"""Device literals in captured graphs: captured on meta, run on the runtime's device.

A graph captured through the export door records the device of every tensor
it creates (`arange(..., device=meta)`, `full(..., device=meta)`: causal
masks, rotary tables), and the passes keep those literals. Whatever runs a
graph on real tensors (the runtime, `with_weights`) first makes them name
its own device, or the created tensors stay on meta and the first op mixing
them with real ones fails.
"""

from __future__ import annotations

import torch
from torch import fx

META = torch.device("meta")


def bind_device(gm: fx.GraphModule, device: torch.device | str) -> None:
    """Make every `device=meta` literal of `gm` and of the GraphModules below it name `device`.

    In place; only the graphs that held such a literal are recompiled.
    """
    device = torch.device(device)
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        changed = False
        for node in module.graph.nodes:
            found: list[object] = []

            def retarget(arg, found=found):
                if isinstance(arg, torch.device) and arg == META:
                    found.append(arg)
                    return device
                return arg

            args = fx.node.map_aggregate(node.args, retarget)
            kwargs = fx.node.map_aggregate(node.kwargs, retarget)
            if found:
                node.args, node.kwargs, changed = args, kwargs, True
        if changed:
            module.recompile()
