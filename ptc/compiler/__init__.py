"""The compiler: capture, node metadata, predicates, FLOPs and model summaries.

Other parts of the compiler (hardware, memory, cost, search, passes) live
beside these modules; this package's top level re-exports what capture
offers.
"""

from ptc.compiler.capture import capture, find_blocks, layer_index, with_weights
from ptc.compiler.meta import (CaptureInfo, NodeInfo, copy_meta, get_info, graph_info, info,
                               set_info, update_info)

__all__ = ["CaptureInfo", "NodeInfo", "capture", "copy_meta", "find_blocks", "get_info",
           "graph_info", "info", "layer_index", "with_weights", "set_info", "update_info"]
