"""Samples are numbered globally; which rank reads which does not change them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_helpers import tiny_plan  # noqa: F401 - puts the repo root on sys.path

from ptc.errors import PtcError
from ptc.plan import DataSpec
from ptc.runtime.data import TokenSource, microbatch_start
from ptc.runtime.synthetic import ToyLanguage

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("kind", ["synthetic", "uniform"])
def test_synthetic_samples_depend_only_on_seed_and_index(kind):
    a = TokenSource(DataSpec(kind=kind, seed=5), vocab=50, seq_len=40)
    b = TokenSource(DataSpec(kind=kind, seed=5), vocab=50, seq_len=40)
    assert np.array_equal(a.sample(17), b.sample(17))
    assert not np.array_equal(a.sample(17), a.sample(18))
    assert not np.array_equal(a.sample(17), TokenSource(DataSpec(kind=kind, seed=6), vocab=50,
                                                         seq_len=40).sample(17))
    sample = a.sample(3)
    assert sample.shape == (41,) and sample.dtype == np.int64
    assert sample.min() >= 0 and sample.max() < 50


def _stream(kind: str, vocab: int = 512) -> np.ndarray:
    source = TokenSource(DataSpec(kind=kind, seed=1), vocab=vocab, seq_len=256)
    return np.stack([source.sample(g) for g in range(200)])


def test_the_toy_language_has_frequent_words_a_successor_rule_and_copied_spans():
    rows = _stream("synthetic")
    language = ToyLanguage(1, 512)
    counts = np.bincount(rows.ravel(), minlength=512) / rows.size
    entropy = -(counts[counts > 0] * np.log(counts[counts > 0])).sum()
    assert entropy < 0.75 * np.log(512)  # uniform noise would be ln(512)
    # the successor rule: half the tokens by construction, about 1/512 by chance
    follows = (rows[:, 1:] == language.successor[rows[:, :-1]]).mean()
    assert 0.35 < follows < 0.75
    # copied spans: 8 tokens that also stand 8 or more positions earlier in the sample
    seen = 0
    for row in rows[:20]:
        grams = [tuple(row[i:i + 8]) for i in range(len(row) - 7)]
        seen += sum(g in set(grams[:max(i - 7, 0)]) for i, g in enumerate(grams))
    assert seen > 20 * 10
    noise = _stream("uniform")
    assert (noise[:, 1:] == language.successor[noise[:, :-1]]).mean() < 0.01


def test_inputs_and_targets_are_the_sample_shifted_by_one():
    src = TokenSource(DataSpec(seed=1), vocab=100, seq_len=6)
    tokens, targets = src.batch(4, 3)
    assert tokens.shape == targets.shape == (3, 6) and tokens.dtype == torch.int64
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    assert torch.equal(tokens[1], torch.from_numpy(src.sample(5)[:-1]))


@pytest.mark.parametrize("dp,micro_batch", [(1, 8), (2, 2), (4, 1), (8, 1)])
def test_every_layout_reads_the_same_global_batch(dp, micro_batch):
    global_batch, step = 8, 3
    micros = global_batch // (dp * micro_batch)
    seen = []
    for rank in range(dp):
        for m in range(micros):
            first = microbatch_start(step, m, dp_rank=rank, dp=dp, global_batch=global_batch,
                                     micro_batch=micro_batch)
            seen.extend(range(first, first + micro_batch))
    assert seen == list(range(step * global_batch, (step + 1) * global_batch))


def test_rank_takes_a_contiguous_slice_micro_batch_by_micro_batch():
    kw = dict(dp=2, global_batch=8, micro_batch=2)
    assert [microbatch_start(0, m, dp_rank=1, **kw) for m in range(2)] == [4, 6]


@pytest.mark.parametrize("suffix,dtype", [(".bin", "uint16"), (".bin", "uint32"),
                                          (".npy", "uint16"), (".npy", "uint32")])
def test_token_files_are_windows_in_order_that_wrap(tmp_path, suffix, dtype):
    tokens = np.arange(23, dtype=dtype)
    path = tmp_path / f"t{suffix}"
    if suffix == ".npy":
        np.save(path, tokens)
    else:
        tokens.tofile(path)
    src = TokenSource(DataSpec(kind="tokens", path=str(path), dtype=dtype), vocab=100, seq_len=5)
    assert list(src.sample(0)) == [0, 1, 2, 3, 4, 5]
    assert list(src.sample(1)) == [5, 6, 7, 8, 9, 10]
    assert list(src.sample(4)) == list(src.sample(0))  # (23 - 1) // 5 = 4 windows, then wrap
    assert src.sample(3).dtype == np.int64


def test_bad_token_files_are_reported(tmp_path):
    np.save(tmp_path / "f.npy", np.zeros(10, dtype=np.float32))
    with pytest.raises(PtcError, match="uint16 or uint32"):
        TokenSource(DataSpec(kind="tokens", path=str(tmp_path / "f.npy")), vocab=10, seq_len=4)
    with pytest.raises(PtcError, match="does not exist"):
        TokenSource(DataSpec(kind="tokens", path=str(tmp_path / "no.bin")), vocab=10, seq_len=4)
    np.zeros(4, dtype=np.uint16).tofile(tmp_path / "short.bin")
    with pytest.raises(PtcError, match="one sample needs"):
        TokenSource(DataSpec(kind="tokens", path=str(tmp_path / "short.bin")), vocab=10,
                    seq_len=4)


def test_a_raw_token_file_of_another_dtype_is_refused_in_one_line(tmp_path):
    """A raw file whose size is not a whole number of the declared tokens, or whose ids are
    a wider integer type (each id then zeros), would train on a stream that is not the one
    written: refused, naming the file and what to declare."""
    ids = np.random.default_rng(0).integers(1, 500, size=1000)
    path = tmp_path / "t.bin"
    ids.astype(np.uint16)[:999].tofile(path)
    path.write_bytes(path.read_bytes() + b"x")  # 1999 bytes: not whole uint16 tokens
    with pytest.raises(PtcError, match=r"1,999 bytes, not a whole number of uint16 tokens"):
        TokenSource(DataSpec(kind="tokens", path=str(path), dtype="uint16"), vocab=512,
                    seq_len=8)
    for written, declared, k, fix in (("int64", "uint16", 4, "written as uint16"),
                                      ("int64", "uint32", 2, "written as uint16"),
                                      ("uint32", "uint16", 2, 'dtype = "uint32"')):
        ids.astype(written).tofile(path)
        with pytest.raises(PtcError, match=rf"read as {declared} is every {k}th token an id "
                           rf"and the {k - 1} between 0, as a file of {written} ids.*{fix}"):
            TokenSource(DataSpec(kind="tokens", path=str(path), dtype=declared), vocab=512,
                        seq_len=8)
    ids.astype(np.uint16).tofile(path)  # as declared: it reads back
    source = TokenSource(DataSpec(kind="tokens", path=str(path), dtype="uint16"), vocab=512,
                         seq_len=8)
    assert list(source.sample(0)) == list(ids[:9])
