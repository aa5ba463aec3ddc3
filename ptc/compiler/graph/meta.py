"""Node metadata: what capture records about every node, under node.meta["ptc"].

Terms: a node's *module path* is the dotted name of the innermost module
whose forward created it ("layers.3.attn.q"; "" for the model's own
forward). Its *layer* is the index of the repeated block it belongs to
(`layers.3...` -> 3), None outside the blocks. Shapes and dtypes are those
of the node's tensor outputs, flattened in output order.

Convention: the metadata is a frozen dataclass, written once at capture.
Passes change it only with `update_info` (dataclasses.replace), and every
node a pass creates gets its source's metadata through `copy_meta`, so no
two nodes ever share a mutable record.

A graph's own record lives under the same key of `gm.meta`: one frozen
`GraphRecord` holding what capture found (`CaptureInfo`) and what the passes
recorded about the graph (its tensor-parallel split, its place in the
pipeline, the overlap decisions of the comm_overlap pass), replaced whole with
`update_graph_record`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import fx

from ptc.compiler.records.graph_meta import KEY, CaptureInfo, GraphRecord, NodeInfo


def graph_record(gm: fx.GraphModule) -> GraphRecord:
    """The GraphRecord of a GraphModule made by ptc's capture or passes."""
    try:
        return gm.meta[KEY]
    except KeyError:
        raise KeyError("this GraphModule was not made by ptc.compiler.capture") from None


def set_graph_record(gm: fx.GraphModule, record: GraphRecord) -> None:
    """Attach `record` to `gm` (capture, and the split for the stage graphs it makes)."""
    gm.meta[KEY] = record


def update_graph_record(gm: fx.GraphModule, **changes: Any) -> GraphRecord:
    """Replace some fields of the graph's record (a new frozen record) and return it."""
    record = dataclasses.replace(graph_record(gm), **changes)
    gm.meta[KEY] = record
    return record


def get_info(node: fx.Node) -> NodeInfo | None:
    """The node's NodeInfo, or None when it has none (e.g. not captured by ptc)."""
    return node.meta.get(KEY)


def info(node: fx.Node) -> NodeInfo:
    """The node's NodeInfo; a KeyError naming the node when it has none."""
    try:
        return node.meta[KEY]
    except KeyError:
        raise KeyError(f"node {node.name!r} ({node.op} {node.target}) has no ptc metadata: "
                       "was it created without copy_meta?") from None


def set_info(node: fx.Node, value: NodeInfo) -> None:
    """Attach `value` to a node (capture does this once per node)."""
    node.meta[KEY] = value


def update_info(node: fx.Node, **changes) -> NodeInfo:
    """Replace some fields of the node's NodeInfo (a new frozen record) and return it."""
    new = dataclasses.replace(info(node), **changes)
    node.meta[KEY] = new
    return new


_PROVENANCE = ("nn_module_stack", "stack_trace")


def copy_meta(src: fx.Node, dst: fx.Node, *, same_value: bool = False, **changes) -> None:
    """Give a created node `dst` the metadata of the node `src` it stands for.

    Copies the NodeInfo (with `changes` applied through dataclasses.replace)
    and torch's provenance keys, so the module path, layer and user source
    line of `src` follow the new node. torch's "val" is copied only with
    `same_value` (a node standing for `src`'s very value, such as a region's
    placeholder): a created node's value generally differs from its source's;
    pass its `shapes` and `dtypes` in `changes` when they do.
    """
    src_info = get_info(src)
    if src_info is not None:
        dst.meta[KEY] = dataclasses.replace(src_info, **changes) if changes else src_info
    elif changes:
        raise KeyError(f"copy_meta: source node {src.name!r} has no ptc metadata to change")
    for key in _PROVENANCE:
        if key in src.meta:
            value = src.meta[key]
            # nn_module_stack is a mutable dict: never let two nodes share one.
            dst.meta[key] = dict(value) if isinstance(value, dict) else value
    if same_value:
        for key in _VALUE:
            if key in src.meta:
                dst.meta[key] = src.meta[key]


_VALUE = ("val", "tensor_meta")
"""torch's keys for the (fake) value a node computes."""


def graph_info(gm: fx.GraphModule) -> CaptureInfo:
    """The CaptureInfo of a captured GraphModule (or of a graph lowered from one)."""
    return graph_record(gm).capture
