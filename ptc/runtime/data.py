"""Training tokens, and which samples each rank reads at each step.

A *sample* is seq_len + 1 consecutive tokens: inputs are its first seq_len,
targets its last seq_len. Samples are numbered globally; sample g depends
only on g and the data source, never on the parallel layout:

- synthetic(seed): sample g is `numpy.random.default_rng([seed, g])`'s
  seq_len + 1 integers in [0, vocab).
- tokens(path): a flat token file read by memory map (`.npy`, or raw `.bin`
  of the plan's uint16/uint32). Sample g is the window starting at token
  (g mod W)·seq_len, where W = (N - 1) // seq_len windows fit in N tokens:
  windows follow the file in order and wrap around at its end.

Step k's global batch is samples k·B .. k·B + B - 1 (B = global_batch)
whatever dp is. dp rank r takes the contiguous slice r·B/dp .. (r+1)·B/dp - 1
and feeds it micro-batch by micro-batch: micro-batch m of rank r is samples
k·B + r·B/dp + m·b .. + b - 1 (b = micro_batch).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ptc.errors import PtcError
from ptc.plan import DataSpec


class TokenSource:
    """Random access to numbered samples of one data source."""

    def __init__(self, spec: DataSpec, *, vocab: int, seq_len: int):
        self.spec, self.vocab, self.seq_len = spec, vocab, seq_len
        self._tokens = _open_tokens(spec) if spec.kind == "tokens" else None
        if self._tokens is not None:
            self._windows = (len(self._tokens) - 1) // seq_len
            if self._windows < 1:
                raise PtcError(f"token file {spec.path} holds {len(self._tokens)} tokens; "
                               f"one sample needs seq_len + 1 = {seq_len + 1}")

    def sample(self, index: int) -> np.ndarray:
        """Sample `index`: seq_len + 1 token ids (int64)."""
        n = self.seq_len + 1
        if self._tokens is None:
            return np.random.default_rng([self.spec.seed, index]).integers(0, self.vocab, n)
        start = (index % self._windows) * self.seq_len
        return np.asarray(self._tokens[start:start + n], dtype=np.int64)

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples first .. first + count - 1 as (inputs, targets), each [count, seq_len] int64."""
        rows = torch.from_numpy(np.stack([self.sample(first + i) for i in range(count)]))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def microbatch_start(step: int, micro: int, *, dp_rank: int, dp: int, global_batch: int,
                     micro_batch: int) -> int:
    """Index of the first sample of micro-batch `micro` of dp rank `dp_rank` at `step`."""
    return step * global_batch + dp_rank * (global_batch // dp) + micro * micro_batch


def _open_tokens(spec: DataSpec) -> np.ndarray:
    path = Path(spec.path)
    if not path.exists():
        raise PtcError(f"token file {path} does not exist")
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.dtype not in (np.uint16, np.uint32) or tokens.ndim != 1:
            raise PtcError(f"{path}: a .npy token file must be 1-D uint16 or uint32, "
                           f"got {tokens.ndim}-D {tokens.dtype}")
        return tokens
    return np.memmap(path, dtype=np.dtype(spec.dtype), mode="r")
