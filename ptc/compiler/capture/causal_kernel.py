"""Give each fused attention that is handed the causal mask the causal kernel instead.

A Hugging Face model builds its causal mask from positions and hands it to
scaled_dot_product_attention: captured, every attention reads a constant
[b, 1, s, s] mask and asks for no causal kernel. A kernel given a mask
computes every query-key tile and applies it; one asked `is_causal` skips
the tiles above the diagonal, half of the work (FlashAttention-2 on GPUs,
torch's flash kernel on CPUs), and reads no mask. Where the mask is exactly
the causal one (`MaskReader.only_causal`: constant, the same for every
sample and head, nothing else in it) the two compute the same attention, so
capture asks for the kernel and drops the mask: the runtime runs it, the
profile prices it (`ptc.compiler.graph.work`), and context parallelism
splits it as any causal attention.
"""

from __future__ import annotations

from torch import fx

from ptc.compiler.graph.masks import MaskReader
from ptc.compiler.graph.nodes import op_name

_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
"""scaled_dot_product_attention's arguments, in order (the aten op's last two by name only)."""


def ask_for_the_causal_kernel(gm: fx.GraphModule, reader: MaskReader) -> int:
    """Rewrite every scaled_dot_product_attention of `gm` given exactly the causal mask into
    one with `is_causal` and no mask, and drop the mask's computation where nothing else
    reads it; returns how many were rewritten."""
    masks = []
    for node in gm.graph.nodes:
        if op_name(node) != "scaled_dot_product_attention" or not reader.only_causal(node):
            continue
        call = dict(zip(_ARGS, node.args)) | dict(node.kwargs)
        masks.append(call["attn_mask"])
        node.args = (call["query"], call["key"], call["value"], None,
                     call.get("dropout_p", 0.0), True)
        node.kwargs = {name: call[name] for name in _ARGS[6:] if name in call}
    if masks:
        _drop_unread(gm, masks)
        gm.graph.lint()
        gm.recompile()
    return len(masks)


def _drop_unread(gm: fx.GraphModule, masks: list) -> None:
    """Erase the masks' nodes, and the nodes only they read, once nothing reads them (never
    an in-place op, whose effect another reader may see)."""
    stack, erased = [m for m in masks if isinstance(m, fx.Node)], set()
    while stack:
        node = stack.pop()
        if node in erased or node.users or node.op not in (
                "call_function", "call_method", "get_attr") or op_name(node).endswith("_"):
            continue
        inputs = node.all_input_nodes
        gm.graph.erase_node(node)
        erased.add(node)
        stack.extend(inputs)
