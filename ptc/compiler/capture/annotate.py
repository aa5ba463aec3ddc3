"""Annotation and provenance: the NodeInfo of every node, and where code came from.

Terms: a node's *provenance* is its module path and class (the innermost
module whose forward made it), its *layer* (the index of the repeated
block it lies in, see `find_blocks`) and its *source*, the "file:line" of
the innermost user frame that made it. *Library* code is torch's and
ptc.compiler's own, and never the user's frame; a frame or stack trace is
read past it to the user's line.

Job: attach one NodeInfo (ptc.compiler.graph.meta) under node.meta["ptc"] to
every node of the captured graph, and find user frames and source lines
for that and for the error messages.
"""

from __future__ import annotations

import functools
import os
import re

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

from ptc.compiler.graph import flops as flops_mod
from ptc.compiler.graph import nodes
from ptc.compiler.capture.evaluate import Evaluator
from ptc.compiler.records.graph_meta import NodeInfo
from ptc.compiler.graph.meta import set_info

_TORCH_DIR = os.path.dirname(torch.__file__)
_COMPILER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def find_blocks(model: nn.Module) -> tuple[str | None, int]:
    """(path, count) of the model's repeated blocks: the ModuleList/Sequential
    of same-class children holding the most parameters; (None, 0) if none."""
    best = None
    for path, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) == 0 or not path:
            continue
        children = list(mod.named_children())
        if len({type(c) for _, c in children}) != 1 or not all(n.isdigit() for n, _ in children):
            continue
        key = (sum(p.numel() for p in mod.parameters()), len(children))
        if best is None or key > best[0]:
            best = (key, path, len(children))
    return (best[1], best[2]) if best else (None, 0)


def layer_index(path: str, blocks: str | None) -> int | None:
    """Index of the block a module path lies in ("layers.3.attn" -> 3), else None."""
    if not blocks or not path.startswith(blocks + "."):
        return None
    head = path[len(blocks) + 1:].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def annotate_graph(gm: fx.GraphModule, root: nn.Module, evaluator: Evaluator,
                   blocks: str | None, dtype: torch.dtype) -> None:
    """Attach a NodeInfo to every node (module path, layer, shapes, FLOPs, params).

    Done once, on the normalised graph, so that passes and cost models read
    what they need from node.meta["ptc"] instead of recomputing it.
    """
    itemsize = dtype.itemsize
    param_cache: dict[str, int] = {}
    for node in gm.graph.nodes:
        kind = nodes.classify(node)
        path, mtype = _provenance(root, node)
        value = evaluator.memo.get(node)
        tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        if node in evaluator.counted:
            node_flops = evaluator.counted[node]
        elif node.op in ("call_function", "call_method", "call_module"):
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), evaluator.memo.__getitem__)
            node_flops = flops_mod.node_flops(node, kind, args, kwargs, value)
        else:
            node_flops = 0
        params = _params_read(gm, node, param_cache)
        set_info(node, NodeInfo(
            module_path=path, module_type=mtype, layer=layer_index(path, blocks), kind=kind,
            shapes=tuple(tuple(t.shape) for t in tensors),
            dtypes=tuple(t.dtype for t in tensors),
            flops=int(node_flops), params=params,
            param_bytes=params * itemsize if params else 0,
            source=source_line(node)))


def _provenance(root: nn.Module, node: fx.Node) -> tuple[str, str]:
    """(module path, class name) of a node; classes looked up in the captured model
    (the graph module's own containers are plain Modules)."""
    if node.op in ("call_module", "get_attr"):
        path = str(node.target) if node.op == "call_module" else \
            str(node.target).rpartition(".")[0]
        try:
            return path, (type(root.get_submodule(path)).__name__ if path else "")
        except AttributeError:
            return path, ""
    path, cls = nodes.stack_entry(node)
    return (path, nodes.class_name(cls)) if path else ("", "")


def _params_read(gm: fx.GraphModule, node: fx.Node, cache: dict[str, int]) -> int:
    if node.op == "call_module":
        if node.target not in cache:
            cache[node.target] = sum(p.numel() for p in gm.get_submodule(node.target).parameters())
        return cache[node.target]
    if node.op == "get_attr":
        value = nodes.get_attr_value(node)
        return value.numel() if isinstance(value, nn.Parameter) else 0
    return 0


_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def source_line(node: fx.Node) -> str | None:
    """"file:line" of the innermost frame of the node's stack trace outside torch.

    The user's own line, for NodeInfo.source and for messages about the node.
    """
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    found = [(p, n) for p, n in _FILE_LINE.findall(trace) if not is_library(p)]
    if not found:
        return None
    path, line = found[-1]
    return f"{short_path(path)}:{line}"


@functools.lru_cache(maxsize=256)
def short_path(path: str) -> str:
    """`path` relative to the working directory when it lies below it.

    Keeps source lines and messages short; cached, as every node asks.
    """
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def is_library(filename: str) -> bool:
    """Whether a file is library code (torch, ptc.compiler, or no file at all)."""
    return filename.startswith(_TORCH_DIR) or filename.startswith(_COMPILER_DIR) or \
        filename.startswith("<")


def user_frame(frame, with_text: bool = True) -> tuple[str, int, str] | None:
    """(file, line, text) of the innermost frame outside torch and ptc.compiler.

    Walks out from `frame`: the fx tracer records it as each node's stack
    trace, and messages quote it. With `with_text` False the third item is
    the function name instead.
    """
    while frame is not None:
        filename = frame.f_code.co_filename
        if not is_library(filename):
            third = line_text(filename, frame.f_lineno) if with_text else frame.f_code.co_name
            return filename, frame.f_lineno, third
        frame = frame.f_back
    return None


def line_text(filename: str, lineno: int) -> str:
    """The text of a source line, stripped ("" when unknown), to quote it in messages."""
    import linecache  # noqa: PLC0415 - error path only

    return linecache.getline(filename, lineno).strip()
