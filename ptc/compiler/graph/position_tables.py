"""Position tables a sequence must fit: embedding lookups of positions, checked at compile.

A model with learned positions (GPT-2's `wpe`, OPT, BioGPT) looks each
position up in a table of `max_position_embeddings` rows. At a longer
`train.seq_len` the lookup indexes past the table: a CPU reports it at the
first step, a GPU as a device-side assertion, both after the processes
started. The indices of such a lookup follow from the sequence's shape, not
from the token values, so they can be computed here on the CPU from the
captured graph, as capture evaluates attention masks
(`ptc.compiler.graph.masks.MaskReader.constant_value`): every one of them must
fall inside the table. Indices that read the inputs' values (token ids) or a
weight are not judged here: token ids are the data checks' (`ptc run`).
"""

from __future__ import annotations

import torch
from torch import fx

from ptc.compiler.graph.masks import MaskReader
from ptc.compiler.graph.nodes import get_attr_value
from ptc.errors import CompileError

_EMBEDDINGS = {torch.ops.aten.embedding.default: (0, 1),
               torch.nn.functional.embedding: (1, 0)}
"""Embedding ops -> positions of (table, indices) among their arguments."""


def check_position_tables(gm: fx.GraphModule, seq_len: int) -> None:
    """CompileError (field train.seq_len) naming the first position table that positions
    of a `seq_len`-token sequence index past (module docstring)."""
    for node in gm.graph.nodes:
        where = _EMBEDDINGS.get(node.target) if node.op == "call_function" else None
        if where is None or len(node.args) < 2 or not isinstance(node.args[where[1]], fx.Node):
            continue
        table, indices = node.args[where[0]], node.args[where[1]]
        rows, judged = _rows(table), _position_range(indices)
        if rows is None or judged is None:
            continue
        low, high = judged
        if low < 0 or high >= rows:
            raise CompileError(
                f"train.seq_len = {seq_len}: the model looks positions up in {table.target}, a table "
                f"of {rows} rows, and a sequence of {seq_len} tokens reads rows {low} to {high}: "
                f"the model takes at most {rows} positions (its max_position_embeddings); "
                "lower seq_len or give the model a longer table", field="train.seq_len")


def _rows(table: fx.Node) -> int | None:
    """Rows of the embedding table `table` reads, when it is a graph attribute."""
    value = get_attr_value(table) if table.op == "get_attr" else None
    return int(value.shape[0]) if isinstance(value, torch.Tensor) and value.dim() == 2 else None


def _position_range(indices: fx.Node) -> tuple[int, int] | None:
    """(min, max) of `indices` when they are the same at every call, whatever the tokens
    (`MaskReader.constant_value`); None when they read the inputs' values or a weight."""
    value = MaskReader().constant_value(indices)
    if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.numel() == 0:
        return None
    return int(value.min()), int(value.max())
