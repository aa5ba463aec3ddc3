"""Regenerating a graph's Python code without regenerating the graphs below it.

fx's `GraphModule.recompile` regenerates the code of the graph and then of
every GraphModule below it, changed or not. After pipeline_split each stage
graph holds one region GraphModule per checkpointed layer, and the pipeline
graph holds the stages, so recompiling that way costs depth × passes of code
generation for graphs nobody touched. A pass recompiles exactly the graphs
it changed (DESIGN convention 1), each with `recompile`; a GraphModule
built around already compiled ones is built under `code_kept`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from torch import fx


def recompile(gm: fx.GraphModule) -> None:
    """Regenerate gm's code from its graph; the code of the GraphModules below it stays."""
    with code_kept(child for child in gm.children() if isinstance(child, fx.GraphModule)):
        gm.recompile()


@contextlib.contextmanager
def code_kept(modules: Iterable[fx.GraphModule]) -> Iterator[None]:
    """Within the block, fx's recompiling of these GraphModules does nothing.

    For graphs whose code is current: a parent's recompile (or construction)
    then leaves them alone. The instance attribute shadows the method and
    is removed on the way out.
    """
    kept = list(modules)
    for module in kept:
        module.recompile = _current
    try:
        yield
    finally:
        for module in kept:
            del module.recompile


def _current() -> None:
    """Stands in for `recompile` of a GraphModule whose code is current."""
