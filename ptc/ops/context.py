"""Context-parallel ops: each rank holds part of every sample's sequence.

Under context parallelism the cp ranks of a group share each sample: its S
positions are cut into 2·cp equal chunks and rank r holds chunks r and
2·cp−1−r, so that under a causal mask every rank has the same amount of
attention work (the early chunks see few keys, the late ones many). Every
op except attention is local to a position, so it runs on the rank's
S/cp positions unchanged; attention needs every earlier position's keys
and values, which `context_attention` all-gathers over cp (Llama 3's
method: the backward reduce-scatters their gradients).

| op                  | forward                                  | backward                     |
|---------------------|------------------------------------------|------------------------------|
| `context_chunks`    | keep the rank's two chunks along `dim`   | zeros at the other positions |
| `context_attention` | all-gather k, v over cp; causal attention | reduce-scatter dk, dv        |
| `context_reduce`    | all-reduce (sum or mean) over cp         | the same all-reduce          |

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
from ptc.ops.positions import chunk_positions, gathered_order
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
    """Causal attention of this rank's queries [b, h, s/cp, d] over every position's keys.

    Keys and values [b, kv, s/cp, d] are all-gathered over cp and put in
    position order; a query at position p attends to the keys at positions
    <= p. `fused`: through scaled_dot_product_attention (what the model
    called), else written out (scores, softmax, probabilities @ values).
    With `dropout_p` and the runtime's keyed samples the probabilities get
    dropout site `site`'s mask of the whole sample (`full`: [heads, s, s]),
    of which the rank keeps its query rows.
    """
    group = axis_group(axis)
    ranks, rank = group_size(group), group_rank(group)
    seq_dim = query.dim() - 2
    key, value = _gather_positions(key, seq_dim, axis), _gather_positions(value, seq_dim, axis)
    length = key.shape[seq_dim]
    rows = chunk_positions(length, rank, ranks, device=query.device)
    allowed = rows[:, None] >= torch.arange(length, device=query.device)[None, :]
    samples = current_samples()
    keyed = dropout_p > 0.0 and samples is not None and site is not None
    if fused and not keyed:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed,
                                              dropout_p=dropout_p, scale=scale,
                                              enable_gqa=enable_gqa)
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    factor = scale if scale is not None else query.shape[-1] ** -0.5
    scores = (query @ key.transpose(-2, -1) * factor).masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if keyed:
        probs = keyed_dropout(probs, dropout_p, site=site, samples=samples, full=full,
                              parts=((probs.dim() - 2, axis),))
    elif dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p, True)
    return probs @ value


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
