"""Synthetic token streams: a learnable toy language, or uniform noise.

`synthetic(seed)` draws its samples from a small language that a model can
be seen learning within a few steps, so a demo or smoke run shows whether
training works:

- words: a Zipf law (p_k proportional to k^-ZIPF_EXPONENT) over the vocabulary
  in an order shuffled by the seed, so a few ids are frequent and most are rare;
- grammar: each id has one successor (a table drawn from the seed), and each
  token after the first follows its predecessor's successor with probability
  FOLLOW instead of a fresh draw;
- memory: spans of COPY_SPAN tokens repeat an earlier span of the same sample
  with probability COPY, which only attention can predict.

`uniform(seed)` is noise: every id equally likely, nothing to learn (the loss
stays at ln(vocab)). Both are functions of (seed, sample index) alone,
whatever the parallel layout reads.
"""

from __future__ import annotations

import numpy as np

ZIPF_EXPONENT = 1.5
"""Skew of the word frequencies."""
FOLLOW = 0.5
"""Probability that a token is its predecessor's successor."""
COPY = 0.5
"""Probability that a span repeats an earlier one."""
COPY_SPAN = (4, 12)
"""Lengths of the spans, drawn uniformly from [low, high)."""


class ToyLanguage:
    """The language of one seed over one vocabulary; `sample(index, n)` draws a sample."""

    def __init__(self, seed: int, vocab: int):
        rng = np.random.default_rng([seed])
        self.seed = seed
        self.words = rng.permutation(vocab)
        """Token id of the k-th most frequent word."""
        self.successor = rng.integers(0, vocab, vocab)
        """The id that may follow each id."""
        weights = 1.0 / np.arange(1, vocab + 1) ** ZIPF_EXPONENT
        self._cdf = np.cumsum(weights / weights.sum())

    def sample(self, index: int, n: int) -> np.ndarray:
        """Sample `index`: n token ids (int64), from its own generator."""
        rng = np.random.default_rng([self.seed, index])
        ranks = np.minimum(np.searchsorted(self._cdf, rng.random(n)), len(self.words) - 1)
        out = self.words[ranks]
        follows = np.flatnonzero(rng.random(n) < FOLLOW)
        follows = follows[follows > 0]
        for _ in range(_longest_run(follows)):  # each pass settles one more link of a chain
            out[follows] = self.successor[out[follows - 1]]
        start = COPY_SPAN[1]
        while start < n:
            length = int(rng.integers(*COPY_SPAN))
            if rng.random() < COPY:
                source = int(rng.integers(0, start - length + 1))
                end = min(start + length, n)
                out[start:end] = out[source:source + end - start]
            start += length
        return out.astype(np.int64)


def uniform_sample(seed: int, index: int, n: int, vocab: int) -> np.ndarray:
    """Sample `index` of uniform noise: n ids in [0, vocab), int64."""
    return np.random.default_rng([seed, index]).integers(0, vocab, n)


def _longest_run(positions: np.ndarray) -> int:
    """Length of the longest run of consecutive integers in sorted `positions`."""
    if positions.size == 0:
        return 0
    breaks = np.flatnonzero(np.diff(positions) != 1)
    bounds = np.concatenate(([-1], breaks, [positions.size - 1]))
    return int(np.diff(bounds).max())
