"""Dropout whose masks depend on the sample, not on the layout: the same run under any split.

torch's dropout draws its mask from the process's random stream, so the mask
a sample gets depends on how many samples share the micro-batch, which rank
holds it and which part of the tensor that rank holds. Then a run under dp,
tp or sequence parallelism cannot reproduce the single-process run, and
neither can be checked against the other. Here every sample's mask comes
from its own generator, seeded from (run seed, dropout site, the sample's
global index), drawn over the sample's *whole* tensor; a rank that holds a
part (its heads under tp, its sequence chunk under sequence parallelism)
keeps the matching part of that mask. Every layout, and eager training that
calls `keyed_dropout` in the same order, applies the same masks.

Terms: a *site* is one dropout call of the model, numbered in forward order
(capture replaces each with `site_dropout`); the *samples* are the global
indices of the micro-batch's samples, set by the runtime around each forward
(`dropout_samples`) and kept for the recomputation of checkpointed regions.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ptc.ops.comm import axis_group, group_rank, group_size
from ptc.ops.positions import chunk_positions


@dataclass(frozen=True)
class Samples:
    """Whose masks a forward draws: the run's seed and the first sample's global index."""

    seed: int
    first: int


_current: Samples | None = None


@contextlib.contextmanager
def dropout_samples(samples: Samples | None) -> Iterator[None]:
    """Draw the masks of `samples` in the forward run inside (None: torch's own dropout)."""
    global _current
    previous, _current = _current, samples
    try:
        yield
    finally:
        _current = previous


def current_samples() -> Samples | None:
    """The samples set by the innermost `dropout_samples`."""
    return _current


def keep_mask(shape: tuple[int, ...], p: float, *, seed: int, site: int, sample: int,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """The keep mask (True: kept) of one sample's whole tensor at one dropout site.

    Drawn in float32 whatever torch's default dtype: a float64 default would draw other
    numbers from the same generator, and so another mask."""
    digest = hashlib.blake2b(f"{seed}/{site}/{sample}".encode(), digest_size=8).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return torch.rand(shape, generator=generator, device=device, dtype=torch.float32) >= p


def keyed_dropout(x: torch.Tensor, p: float, *, site: int, samples: Samples,
                  full: tuple[int, ...] | None = None, axis: str = "tp",
                  parts: tuple[tuple[int, str], ...] = (),
                  window: tuple[slice, ...] = ()) -> torch.Tensor:
    """Dropout of `x` [samples, ...] with each sample's mask from `keep_mask`.

    `full`: the shape of one sample's whole tensor when `x` holds a part of
    it. `window`: slices of that whole tensor, from its first dim, that `x`
    holds whatever the layout (one query chunk's rows and the keys before
    them), taken first. `parts`: (dim of x, mesh axis) pairs saying how the
    layout splits the rest, applied in order: the rank keeps its part along
    that dim (its two chunks along "cp", its contiguous slice along any other
    axis). A dim still larger than x's after them is split over `axis`,
    contiguously.
    """
    if p == 0.0:
        return x
    whole = tuple(full) if full is not None else tuple(x.shape[1:])
    masks = torch.stack([keep_mask(whole, p, seed=samples.seed, site=site,
                                   sample=samples.first + j, device=x.device)
                         for j in range(x.shape[0])])
    masks = masks[(slice(None), *window)]
    local = tuple(x.shape)
    for dim, part_axis in parts:
        masks = _rank_part(masks, dim, part_axis, masks.shape[dim] // _ranks(part_axis))
    if masks.shape != local:
        dim = next(d for d in range(len(local)) if masks.shape[d] != local[d])
        masks = _rank_part(masks, dim, axis, local[dim])
    # A copy of the rank's part: a narrowed view saved for backward would keep every
    # rank's part of the mask alive (tp times the bytes the memory model charges).
    return _Masked.apply(x, masks.contiguous(), 1.0 / (1.0 - p))


def _ranks(axis: str) -> int:
    return group_size(axis_group(axis))


def _rank_part(masks: torch.Tensor, dim: int, axis: str, size: int) -> torch.Tensor:
    """This rank's `size` entries of `masks` along `dim` on mesh axis `axis`."""
    group = axis_group(axis)
    if axis == "cp":
        index = chunk_positions(masks.shape[dim], group_rank(group), group_size(group),
                                device=masks.device)
        return masks.index_select(dim, index)
    return masks.narrow(dim, group_rank(group) * size, size)


class _Masked(torch.autograd.Function):
    """x · mask · scale, keeping the one-byte mask (not a mask in x's dtype) for backward."""

    @staticmethod
    def forward(ctx, x, mask, scale):  # noqa: D102
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return x * mask * scale

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        (mask,) = ctx.saved_tensors
        return grad * mask * ctx.scale, None, None


def site_dropout(x: torch.Tensor, p: float, train: bool, site: int,
                 full: tuple[int, ...] | None = None,
                 parts: tuple[tuple[int, str], ...] = ()) -> torch.Tensor:
    """A captured dropout call: keyed by the current samples, or torch's when none are set
    (a Program run by hand) or when not training (`full`, `parts`: as `keyed_dropout`'s)."""
    if not train or p == 0.0:
        return x
    samples = current_samples()
    if samples is None:
        return torch.nn.functional.dropout(x, p, True)
    return keyed_dropout(x, p, site=site, samples=samples, full=full, parts=parts)


def site_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                   is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False, *, site: int,
                   full: tuple[int, ...] | None = None) -> torch.Tensor:
    """scaled_dot_product_attention with its dropout on the probabilities keyed by sample.

    Written out (scores, softmax, keyed dropout, values), as torch's math
    backend computes it, so that the dropout mask is `keyed_dropout`'s;
    `full`: the shape of one sample's whole probabilities [heads, sq, sk]
    when `query` holds some of the heads.
    """
    samples = current_samples()
    if samples is None or dropout_p == 0.0:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=scale, enable_gqa=enable_gqa)
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    factor = scale if scale is not None else query.shape[-1] ** -0.5
    scores = query @ key.transpose(-2, -1) * factor
    if is_causal:
        sq, sk = scores.shape[-2:]
        causal = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask
    probs = torch.softmax(scores, dim=-1)
    probs = keyed_dropout(probs, dropout_p, site=site, samples=samples, full=full)
    return probs @ value
