"""Dropout masks that belong to the sample: the same whether it runs alone, in a batch, or split.

`ptc.ops.dropout` draws each sample's mask from a generator keyed by (seed,
site, global sample index) over the sample's whole tensor. So a micro-batch
of 2 at samples 10..11 drops what a batch of 4 at samples 10..13 drops for
those samples, and capture numbers every dropout of a graph as such a site.
The distributed equivalence tests (tp, sp, dp, pp, recompute with dropout
on) are in tests/distributed/test_tp_equivalence.py and test_hf_models.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ptc.compiler.capture import capture  # noqa: E402
from ptc.models import build_model  # noqa: E402
from ptc.ops.dropout import Samples, keyed_dropout, site_dropout  # noqa: E402
from ptc.plan import ModelSpec  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_a_samples_mask_does_not_depend_on_its_batch():
    x = torch.ones(4, 8, 16)
    whole = keyed_dropout(x, 0.5, site=3, samples=Samples(seed=0, first=10))
    parts = [keyed_dropout(x[:2], 0.5, site=3, samples=Samples(seed=0, first=10)),
             keyed_dropout(x[2:], 0.5, site=3, samples=Samples(seed=0, first=12))]
    assert torch.equal(whole, torch.cat(parts))
    assert set(whole.unique().tolist()) == {0.0, 2.0}  # dropped, or kept and scaled by 1/(1-p)
    other = keyed_dropout(x, 0.5, site=4, samples=Samples(seed=0, first=10))
    assert not torch.equal(whole, other)  # another site draws another mask
    assert abs(whole.eq(0).float().mean().item() - 0.5) < 0.05


def test_gradients_pass_the_kept_elements_only():
    x = torch.randn(2, 32, requires_grad=True)
    y = keyed_dropout(x, 0.25, site=0, samples=Samples(seed=1, first=0))
    y.sum().backward()
    kept = y.detach() != 0
    assert torch.equal(x.grad, kept.float() / 0.75)


def test_outside_training_or_at_p_zero_it_is_the_identity():
    x = torch.randn(2, 8)
    assert site_dropout(x, 0.5, False, 0) is x and site_dropout(x, 0.0, True, 0) is x


def test_capture_numbers_every_dropout_and_records_a_samples_shape():
    spec = ModelSpec(family="gpt", layers=2, hidden=32, heads=4, vocab=64, max_seq=16,
                     dropout=0.1)
    gm = capture(build_model(spec), micro_batch=2, seq_len=16)
    sites = [n for n in gm.graph.nodes if n.target is site_dropout]
    # the embedding's, then per layer: attention probabilities, attention out, MLP out
    assert [n.args[3] for n in sites] == list(range(7))
    assert sites[1].args[4] == (4, 16, 16) and sites[0].args[4] == (16, 32)


def test_a_rank_keeps_only_its_part_of_the_mask():
    """Split over tp = 2, a rank saves for backward one byte per element of its own half of
    the sample's mask, not a view that keeps the whole mask alive."""
    from ptc.ops.comm import ShapeGroup, bind_axes

    x = torch.ones(2, 8, 16, requires_grad=True)  # this rank's 8 of 16 positions
    saved = []

    def pack(tensor):
        saved.append(tensor.untyped_storage().nbytes())
        return tensor

    with bind_axes({"tp": ShapeGroup(2)}), torch.autograd.graph.saved_tensors_hooks(
            pack, lambda t: t):
        out = keyed_dropout(x, 0.5, site=0, samples=Samples(seed=0, first=0), full=(16, 16))
    assert out.shape == x.shape
    assert saved == [x.numel()]  # a bool mask of the rank's part
