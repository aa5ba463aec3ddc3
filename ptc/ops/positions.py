"""Which positions of a sequence each context-parallel rank holds.

The sequence is cut into 2·cp equal chunks and rank r holds chunks r and
2·cp−1−r (in that order), which balances causal attention's work over the
ranks (`ptc.ops.context`); the keyed dropout masks (`ptc.ops.dropout`) and
the memory of every split activation follow the same assignment.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=64)
def chunk_positions(length: int, rank: int, ranks: int, device=None) -> torch.Tensor:
    """The positions 0..length-1 that cp rank `rank` of `ranks` holds, in its local order:
    chunk `rank`, then chunk 2·ranks−1−rank, of 2·ranks equal chunks. Cached (every
    attention of every step asks for the same ones); callers only read it."""
    if ranks == 1:
        return torch.arange(length, device=device)
    chunk = length // (2 * ranks)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * ranks - 1 - rank) * chunk, (2 * ranks - rank) * chunk, device=device)
    return torch.cat([first, last])


def query_chunks(length: int, rank: int, ranks: int) -> tuple[tuple[int, int, int], ...]:
    """The runs of consecutive positions cp rank `rank` of `ranks` holds of a sequence of
    `length`, as (start in the rank's local order, positions, end in the whole sequence): a
    causal query there meets the keys before `end` only. One run when `ranks` is 1."""
    if ranks == 1:
        return ((0, length, length),)
    chunk = length // (2 * ranks)
    return ((0, chunk, (rank + 1) * chunk), (chunk, chunk, (2 * ranks - rank) * chunk))


@functools.lru_cache(maxsize=64)
def gathered_order(length: int, ranks: int, device=None) -> torch.Tensor:
    """Index that puts a cp all-gather (rank 0's positions, then rank 1's, ...) back in
    position order: gathered[order] is the tensor of positions 0..length-1 (cached, read
    only)."""
    held = torch.cat([chunk_positions(length, r, ranks) for r in range(ranks)])
    return torch.argsort(held).to(device)
