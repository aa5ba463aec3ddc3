"""The compiler: capture, node metadata, predicates, FLOPs and model summaries.

Other parts of the compiler (topology, memory, cost, search, program) live
beside these modules. The names below are re-exported lazily, so importing a
torch-free submodule (`ptc.compiler.topology`) does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "capture": "capture", "find_blocks": "capture", "layer_index": "capture",
    "with_weights": "capture",
    "CaptureInfo": "meta", "NodeInfo": "meta", "copy_meta": "meta", "get_info": "meta",
    "graph_info": "meta", "info": "meta", "set_info": "meta", "update_info": "meta",
    "ModelSummary": "summary", "summarize": "summary", "render_summary": "summary",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """Import `name` from its submodule on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ptc.compiler' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ptc.compiler.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
