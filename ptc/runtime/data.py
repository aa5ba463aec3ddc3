"""Training tokens, and which samples each rank reads at each step.

A *sample* is seq_len + 1 consecutive tokens: inputs are its first seq_len,
targets its last seq_len. Samples are numbered globally; sample g depends
only on g and the data source, never on the parallel layout:

- synthetic(seed): sample g is drawn by `numpy.random.default_rng([seed, g])`
  from a toy language of the seed (`ptc.runtime.synthetic`): frequent and
  rare words, a successor rule, copied spans; a model visibly learns it.
- uniform(seed): sample g is that generator's seq_len + 1 integers in
  [0, vocab): noise, nothing to learn.
- tokens(path): a flat token file read by memory map (`.npy`, or raw `.bin`
  of the plan's uint16/uint32). Sample g is the window starting at token
  (g mod W)·seq_len, where W = (N - 1) // seq_len windows fit in N tokens:
  windows follow the file in order and wrap around at its end. A raw file
  whose size is not a whole number of tokens, or whose start reads as ids of
  a wider integer type (each id, then zeros: int64 ids declared uint16), is
  refused: read as declared it would train on another stream.

Every token id must be below the model's vocab: a batch holding one that is
not is refused (PtcError naming the file and the token's position) before it
reaches the model, where an out-of-range id would fail deep inside (tp = 1)
or be masked and train silently (a vocab-parallel embedding). `check_data`
scans a whole file (up to FULL_SCAN_TOKENS) before any process starts.

Step k's global batch is samples k·B .. k·B + B - 1 (B = global_batch)
whatever dp is. dp rank r takes the contiguous slice r·B/dp .. (r+1)·B/dp - 1
and feeds it micro-batch by micro-batch: micro-batch m of rank r is samples
k·B + r·B/dp + m·b .. + b - 1 (b = micro_batch).
"""

from __future__ import annotations

from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np

from ptc.errors import PtcError
from ptc.plan import DataSpec
from ptc.runtime.synthetic import ToyLanguage, uniform_sample

if TYPE_CHECKING:  # loaded by `batch`: checking a token file needs no torch
    import torch


FULL_SCAN_TOKENS = 1 << 28
"""Files up to this many tokens (512 MiB of uint16) are scanned whole by `check_data`;
larger ones are checked batch by batch only."""
SCAN_CHUNK = 1 << 24
"""Tokens read at a time while scanning."""


class TokenSource:
    """Random access to numbered samples of one data source."""

    def __init__(self, spec: DataSpec, *, vocab: int, seq_len: int):
        self.spec, self.vocab, self.seq_len = spec, vocab, seq_len
        self._tokens = _open_tokens(spec) if spec.kind == "tokens" else None
        self._language: ToyLanguage | None = None
        if self._tokens is not None:
            self._windows = (len(self._tokens) - 1) // seq_len
            if self._windows < 1:
                raise PtcError(f"token file {spec.path} holds {len(self._tokens)} tokens; "
                               f"one sample needs seq_len + 1 = {seq_len + 1}")

    def sample(self, index: int) -> np.ndarray:
        """Sample `index`: seq_len + 1 token ids (int64)."""
        n = self.seq_len + 1
        if self.spec.kind == "synthetic":
            if self._language is None:  # drawn once, when the vocabulary is known
                self._language = ToyLanguage(self.spec.seed, self.vocab)
            return self._language.sample(index, n)
        if self._tokens is None:
            return uniform_sample(self.spec.seed, index, n, self.vocab)
        start = (index % self._windows) * self.seq_len
        window = np.asarray(self._tokens[start:start + n], dtype=np.int64)
        if self.vocab is not None and window.max(initial=0) >= self.vocab:
            self._refuse(start + int(np.argmax(window >= self.vocab)))
        return window

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples first .. first + count - 1 as (inputs, targets), each [count, seq_len] int64."""
        import torch  # noqa: PLC0415 - see the imports

        rows = torch.from_numpy(np.stack([self.sample(first + i) for i in range(count)]))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def scan(self, *, up_to: int | None = None) -> None:
        """Check every token of the file (PtcError at the first id >= vocab); a file of more
        than `up_to` tokens is left to the per-batch check."""
        if self._tokens is None or self.vocab is None or (
                up_to is not None and len(self._tokens) > up_to):
            return
        for start in range(0, len(self._tokens), SCAN_CHUNK):
            chunk = self._tokens[start:start + SCAN_CHUNK]
            if chunk.max(initial=0) >= self.vocab:
                self._refuse(start + int(np.argmax(chunk >= self.vocab)))

    def _refuse(self, position: int) -> None:
        raise PtcError(f"train.data: token file {self.spec.path}: token {int(self._tokens[position])}"
                       f" at position {position} is outside the vocabulary: model.vocab = "
                       f"{self.vocab} takes ids 0 .. {self.vocab - 1}")


def check_data(spec: DataSpec, *, vocab: int, seq_len: int) -> None:
    """Open the plan's data and, for a token file of up to FULL_SCAN_TOKENS, check every id;
    PtcError on the first problem (a missing or short file, an id outside the vocabulary)."""
    TokenSource(spec, vocab=vocab, seq_len=seq_len).scan(up_to=FULL_SCAN_TOKENS)


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
    dtype = np.dtype(spec.dtype)
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise PtcError(f"train.data: token file {path} is {size:,} bytes, not a whole number "
                       f"of {dtype.name} tokens of {dtype.itemsize} bytes: it holds another "
                       f"dtype or was cut short (train.data's dtype: uint16 or uint32)")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    wider = _wider_file(tokens, dtype)
    if wider is not None:
        name, k = wider
        fix = 'dtype = "uint32"' if name == "uint32" else "the ids written as uint16 or uint32"
        raise PtcError(f"train.data: token file {path} read as {dtype.name} is every {k}th token "
                       f"an id and the {k - 1} between 0, as a file of {name} ids reads: train "
                       f"on it as it is and the model sees mostly token 0; give it {fix}")
    return tokens


SNIFF_TOKENS = 1 << 20
"""Tokens of a raw file's start that `_wider_file` reads."""


def _wider_file(tokens: np.ndarray, dtype: np.dtype) -> tuple[str, int] | None:
    """(dtype, k) when the raw file `tokens` (read as `dtype`) holds ids of a wider integer
    type: little-endian, each wide id reads as its value then k - 1 zeros (an int64 id below
    2^16 read as uint16: the id and three 0s), which a real token stream never shows at
    every k-th place. None when its first SNIFF_TOKENS tokens do not show it (or are too few,
    under 64, to tell)."""
    head = np.asarray(tokens[:SNIFF_TOKENS])
    for name in ("int64", "uint32"):
        k = np.dtype(name).itemsize // dtype.itemsize
        if k < 2 or len(head) < 64:
            continue
        rows = head[:len(head) // k * k].reshape(-1, k)
        if rows[:, 0].any() and not rows[:, 1:].any():
            return name, k
    return None
