"""Device literals in captured graphs: captured on meta, run on the runtime's device.

A graph captured through the export door records the device of every tensor
it creates (`arange(..., device=meta)`, `full(..., device=meta)`: causal
masks, rotary tables), and the passes keep those literals. Whatever runs a
graph on real tensors (the runtime, `with_weights`) first makes them name
its own device, or the created tensors stay on meta and the first op mixing
them with real ones fails.

A model may also pick ops by device while it is captured: transformers' MoE
counts tokens per expert with `histc` of integer ids off the CPU, of floats
on it (integer histc has no CPU kernel). Captured on meta, the graph holds
the first form; on a CPU the ids are cast to float (exact below 2**24).
"""

from __future__ import annotations

import torch
from torch import fx

from ptc.compiler.graph.meta import copy_meta, get_info
from ptc.compiler.graph.nodes import op_name

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
            if device.type in ("cpu", "mps") and _integer_histc(node):
                with module.graph.inserting_before(node):
                    ids = module.graph.call_method("float", (node.args[0],))
                copy_meta(node, ids, kind="pointwise", flops=0, params=0, param_bytes=0)
                node.replace_input_with(node.args[0], ids)
                changed = True
        if changed:
            module.recompile()


def _integer_histc(node: fx.Node) -> bool:
    """Whether `node` is a histc of an integer tensor (which CPUs cannot count)."""
    if op_name(node) != "histc" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    info = get_info(node.args[0])
    return info is not None and bool(info.dtypes) and not info.dtypes[0].is_floating_point
