"""Data-parallel gradient reductions with float8 on the wire (`parallel.grad_comm`).

Opt-in and numerics-changing: a gradient that crosses the network as
float8 comes back rounded to 3 (e4m3) or 2 (e5m2) mantissa bits.

Terms: w ranks in the group, a flat buffer of N = w·n elements laid out by
destination rank (block r is what rank r keeps), as the gradient buckets are.

- Quantising: each rank scales its whole buffer by one factor, the format's
  largest finite value over the buffer's largest magnitude, so its largest
  element lands on the format's maximum and none overflows; the scale (one
  fp32) travels beside the bytes.
- Reduce-scatter: an all-to-all of the quantised blocks (rank r receives
  every rank's block r) and an all-gather of the scales; each rank then
  dequantises the w blocks and sums them in fp32, in rank order.
- All-reduce: that reduce-scatter, then each rank quantises its summed shard
  again and all-gathers the bytes and scales; every rank dequantises the same
  bytes with the same scales, so every rank holds the same sums.

Bytes each rank sends: (w−1)/w·N for the reduce-scatter and twice that for
the all-reduce, one byte an element (plus 4 per rank for the scales): half of
what a bf16 ring moves, a quarter of fp32's. gloo carries the bytes as uint8.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ptc.ops.comm import Group, Work, all_gather_flat, group_size, note

FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
"""`parallel.grad_comm` value -> the float8 format gradients travel in."""


def quantize(x: torch.Tensor, fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(`x` scaled into `fmt` and viewed as bytes, the scale as a 1-element fp32 tensor)."""
    amax = x.detach().abs().max().float()
    top = torch.finfo(fmt).max
    scale = torch.where(amax > 0, top / amax, torch.ones_like(amax)).reshape(1)
    scaled = (x.detach().float() * scale).clamp(-top, top)  # rounding up past the top: clamp
    return scaled.to(fmt).view(torch.uint8), scale


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """fp32 values of `blocks` ([w, n] bytes of `fmt`, row r scaled by `scales[r]`)."""
    return blocks.view(fmt).float() / scales.view(-1, 1)


class Fp8Reduction:
    """A float8 reduce-scatter or all-reduce in flight (see the module docstring).

    The first stage (all-to-all of blocks and scales) starts at once; `wait()`
    finishes it, sums, and for an all-reduce runs the gather of the sums.
    """

    def __init__(self, flat: torch.Tensor, group: Group, fmt: torch.dtype, *, everywhere: bool):
        """Start reducing `flat` over `group` in `fmt`; `everywhere`: all-reduce (the sums land
        in `flat`, in place, as `all_reduce_flat` leaves them), else reduce-scatter."""
        self.flat, self.group, self.fmt, self.everywhere = flat, group, fmt, everywhere
        self.world = group_size(group)
        sent, scale = quantize(flat, fmt)
        blocks = torch.empty_like(sent)
        note("all_to_all", group, sent)
        self._blocks = Work(dist.all_to_all_single(blocks, sent, group=group, async_op=True),
                            blocks, sent)
        self._scales = all_gather_flat(scale, group)
        self.output: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        """Block until the sums are here: this rank's block (reduce-scatter), or `flat`."""
        if self.output is None:
            blocks = self._blocks.wait().view(self.world, -1)
            shard = dequantize(blocks, self._scales.wait(), self.fmt).sum(0)
            if not self.everywhere:
                self.output = shard.to(self.flat.dtype)
            else:
                sent, scale = quantize(shard, self.fmt)
                gathered, scales = all_gather_flat(sent, self.group), all_gather_flat(scale,
                                                                                     self.group)
                sums = dequantize(gathered.wait().view(self.world, -1), scales.wait(), self.fmt)
                self.output = self.flat.copy_(sums.view(-1))
        return self.output


def fp8_reduction(fmt: torch.dtype, *, everywhere: bool):
    """A flat collective moving `fmt` bytes: an all-reduce in place as `all_reduce_flat`
    (`everywhere`), else a reduce-scatter as `reduce_scatter_flat`."""
    def reduce(flat: torch.Tensor, group: Group) -> Work | Fp8Reduction:
        if group_size(group) == 1:
            return Work(None, flat)
        return Fp8Reduction(flat, group, fmt, everywhere=everywhere)
    return reduce
