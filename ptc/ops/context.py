"""Context-parallel ops: each rank holds part of every sample's sequence.

Under context parallelism the cp ranks of a group share each sample: its S
positions are cut into 2·cp equal chunks and rank r holds chunks r and
2·cp−1−r, so that under a causal mask every rank has the same amount of
attention work (the early chunks see few keys, the late ones many). Every
op except attention is local to a position, so it runs on the rank's
S/cp positions unchanged; attention needs every earlier position's keys
and values, which `context_attention` all-gathers over cp (Llama 3's
method: the backward reduce-scatters their gradients). Each of the rank's
chunks then meets only the keys up to its own end, so no rank computes the
products a causal mask discards wholesale (`key_tile_share`).

| op                  | forward                                          | backward                     |
|---------------------|--------------------------------------------------|------------------------------|
| `context_chunks`    | keep the rank's two chunks along `dim`           | zeros at the other positions |
| `context_attention` | all-gather k, v over cp; each chunk's queries    | reduce-scatter dk, dv        |
|                     | attend causally to the keys up to its end        |                              |
| `context_reduce`    | all-reduce (sum or mean) over cp                 | the same all-reduce          |

A sum or mean over the sequence (a load-balancing loss's fraction of tokens per
expert) is each rank's over its positions, then `context_reduce`d into the whole
sequence's.

A tensor that every cp rank holds whole (the batch's tokens, a position
table) enters through `context_chunks`; gradients are summed over cp with
the data-parallel ones (the runtime reduces over dp·cp), so its producer's
parameters see every position's gradient.

Ops name the mesh axis "cp", never a process group (`ptc.ops.comm`); an
unbound axis is one rank, and then every op is the plain computation.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ptc.ops.comm import axis_group, group_rank, group_size
from ptc.ops.dropout import current_samples, keyed_dropout
from ptc.ops.positions import chunk_positions, gathered_order, query_chunks
from ptc.ops.tp_ops import all_gather_seq, copy_to_tp, reduce_from_tp

CP = "cp"
"""The mesh axis of context parallelism."""


def context_chunks(x: torch.Tensor, dim: int = 1, axis: str = CP) -> torch.Tensor:
    """This rank's positions of a tensor every cp rank holds whole, along `dim`.

    Backward: the gradient at the rank's positions, zeros elsewhere (the
    runtime sums it over cp with the data-parallel gradients).
    """
    group = axis_group(axis)
    ranks = group_size(group)
    if ranks == 1:
        return x
    dim = dim % x.dim()
    index = chunk_positions(x.shape[dim], group_rank(group), ranks, device=x.device)
    return x.index_select(dim, index)


def _gather_positions(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    """Every rank's positions of x joined along `dim`, in position order."""
    ranks = group_size(axis_group(axis))
    whole = all_gather_seq(x, dim, axis)
    order = gathered_order(whole.shape[dim], ranks, device=x.device)
    return whole.index_select(dim, order)


def context_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                      scale: float | None = None, dropout_p: float = 0.0,
                      enable_gqa: bool = False, site: int | None = None,
                      full: tuple[int, ...] | None = None, fused: bool = True,
                      axis: str = CP) -> torch.Tensor:
    """Causal attention of this rank's queries [b, h, s/cp, d] over the keys before them.

    Keys and values [b, kv, s/cp, d] are all-gathered over cp and put in
    position order. Each of the rank's two query chunks meets only the keys up
    to its own chunk's end (`query_chunks`), under the causal mask aligned to
    that end: the products of the keys after it, about half of the sequence's,
    are never computed (`key_tile_share`). `fused`: through
    scaled_dot_product_attention (what the model called), else written out
    (scores, softmax, probabilities @ values). With `dropout_p` and the
    runtime's keyed samples the probabilities get dropout site `site`'s mask
    of the whole sample (`full`: [heads, s, s]), of which each chunk keeps its
    rows and keys.
    """
    group = axis_group(axis)
    seq_dim = query.dim() - 2
    key, value = _gather_positions(key, seq_dim, axis), _gather_positions(value, seq_dim, axis)
    samples = current_samples()
    keyed = dropout_p > 0.0 and samples is not None and site is not None
    outputs = []
    for start, size, end in query_chunks(key.shape[seq_dim], group_rank(group),
                                         group_size(group)):
        q = query.narrow(seq_dim, start, size)
        k, v = key.narrow(seq_dim, 0, end), value.narrow(seq_dim, 0, end)
        if fused and not keyed:  # the first chunk of the first rank is the plain causal one
            outputs.append(F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if size == end else _before_end(size, end, q.device),
                is_causal=size == end, dropout_p=dropout_p, scale=scale,
                enable_gqa=enable_gqa))
        else:
            outputs.append(_written_out(q, k, v, scale=scale, dropout_p=dropout_p,
                                        enable_gqa=enable_gqa,
                                        dropout=(site, samples, full) if keyed else None))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, seq_dim)


def _written_out(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                 scale: float | None, dropout_p: float, enable_gqa: bool,
                 dropout: tuple | None) -> torch.Tensor:
    """Causal attention of the query chunk ending where `key` ends (the mask aligned to the
    last key), written out; `dropout`: (site, samples, full) of the keyed mask, else torch's
    dropout (when `dropout_p`)."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    size, end = query.shape[-2], key.shape[-2]
    allowed = _before_end(size, end, query.device)
    factor = scale if scale is not None else query.shape[-1] ** -0.5
    scores = (query @ key.transpose(-2, -1) * factor).masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if dropout is not None:
        site, samples, full = dropout
        window = (slice(None), slice(end - size, end), slice(0, end))
        probs = keyed_dropout(probs, dropout_p, site=site, samples=samples, full=full,
                              window=window)
    elif dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p, True)
    return probs @ value


def _before_end(size: int, end: int, device: torch.device) -> torch.Tensor:
    """The causal mask [size, end] of the `size` queries just before position `end` over
    the keys 0..end-1 (True: attended): each meets the keys at or before its own position."""
    rows = torch.arange(end - size, end, device=device)
    return rows[:, None] >= torch.arange(end, device=device)[None, :]


def key_tile_share(ranks: int) -> float:
    """The share of the whole sequence's query-key products (every tile, masked or not) one
    cp rank's attention computes, for `ranks` >= 2. Its two chunks of c = S/(2·ranks)
    queries meet the keys up to their own chunk's end, (r+1)·c and (2·ranks−r)·c keys:
    (2·ranks+1)·c² products of (2·ranks·c)² on every rank but the first, whose first chunk,
    the only square one, runs as the plain causal kernel and skips half of it. Every kernel
    computes each tile of a masked call: the causal half of the whole over `ranks` and the
    masked half of the chunks on the diagonal, c² more."""
    return (2 * ranks + 1) / (4 * ranks * ranks)


context_attention.ptc_collective = ("all-gather k, v over cp", "reduce-scatter dk, dv over cp")


def context_reduce(x: torch.Tensor, mean: bool = False, axis: str = CP) -> torch.Tensor:
    """The whole sequence's sum (`mean`: mean) of a reduction each rank made over its own
    positions: the ranks' results summed (averaged: every rank holds as many positions).

    Forward: all-reduce over cp. Backward: the same all-reduce of the gradient, so each
    rank's positions get the gradient of every rank's loss through the reduction (the
    runtime then averages gradients over dp·cp, as it does the losses).
    """
    ranks = group_size(axis_group(axis))
    if ranks == 1:
        return x
    total = reduce_from_tp(copy_to_tp(x, axis), axis)
    return total / ranks if mean else total


context_reduce.ptc_collective = ("all-reduce over cp", "all-reduce over cp")
