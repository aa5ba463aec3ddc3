"""GraphModules whose Python code is generated when it is first needed, not at every edit.

fx generates a GraphModule's Python code when the module is built and at
every `recompile`, and a recompile regenerates the code of every
GraphModule below it too. Lowering builds and edits graphs many times (a
stage graph per pipeline stage, a region per checkpointed layer, a
recompile per pass that changes a graph), and `ptc compile`, `explain`
and `estimate` never run them: generating that code cost a compile as
much again per layer as the passes' own work.

ptc's graphs are `LoweredGraph`s: `recompile` only marks the code stale
(fx's `_LazyGraphModule`), and the code is generated at the first call,
the first read of `.code`, or when the module is pickled. `with_code`
generates it for a whole module tree before the runtime takes its
`forward` (torch.compile traces that function, and a failing node is
found through its line map). `code_version` tells whether a pass
changed a graph: it counts the graph's recompiles.
"""

from __future__ import annotations

from torch import fx, nn
from torch.fx._lazy_graph_module import _LazyGraphModule


class LoweredGraph(_LazyGraphModule):
    """A GraphModule that generates its code lazily and counts its recompiles."""

    @classmethod
    def recompile(cls) -> None:
        """Mark the code stale (fx makes a class per GraphModule: the count is this one's)."""
        cls.code_version = getattr(cls, "code_version", 0) + 1
        super().recompile()


def graph_module(root: nn.Module | dict, graph: fx.Graph,
                 class_name: str = "GraphModule") -> fx.GraphModule:
    """A LoweredGraph of `graph`, taking the modules and attributes it reads from `root`."""
    return LoweredGraph(root, graph, class_name)


def owner_module(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(module, attribute) that a dotted `name` under `root` names, the modules on its path
    added as empty containers where missing (a GraphModule holds only what its graph reads)."""
    path, _, leaf = name.rpartition(".")
    owner = root
    for part in filter(None, path.split(".")):
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    return owner, leaf


def code_version(gm: fx.GraphModule) -> object:
    """Changes whenever gm's graph is recompiled (for an eager GraphModule: its code)."""
    return getattr(type(gm), "code_version", 0) if isinstance(gm, LoweredGraph) else gm.code


def with_code(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm`, with the Python code of it and of every GraphModule below it generated."""
    for module in gm.modules():
        if isinstance(module, _LazyGraphModule):
            module.real_recompile()
    return gm
