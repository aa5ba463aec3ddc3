"""A tensor made blank and filled slice by slice in place becomes the cat of its slices.

`to_cat_form` runs at the start of the tensor_parallel pass (DeepSeek-V3 builds
its keys so); here it runs alone on graphs captured through the export door,
which are then executed with real weights to show the rewrite computes what the
module does. A blank that is not tiled by its copies is left as it is.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ptc.compiler.capture import capture, with_weights  # noqa: E402
from ptc.compiler.graph.nodes import op_name  # noqa: E402
from ptc.passes.cat_form import to_cat_form  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class Filled(nn.Module):
    """Features written into a blank tensor piece by piece, as DeepSeek-V3 writes its keys;
    `pieces` of them (1: the last 8 features keep their zeros)."""

    def __init__(self, pieces: int):
        super().__init__()
        self.pieces = pieces
        self.embed = nn.Embedding(64, 32)
        self.wide = nn.Linear(32, 24)
        self.narrow = nn.Linear(32, 8)
        self.head = nn.Linear(32, 64)

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        torch.finfo(h.dtype)  # stops symbolic tracing: the export door records aten ops
        out = h.new_zeros(*h.shape)
        out[..., :24].copy_(self.wide(h))
        if self.pieces == 2:
            out[..., 24:].copy_(self.narrow(h))
        return F.cross_entropy(self.head(out).flatten(0, 1), targets.flatten())


def _names(gm) -> list[str]:
    return [op_name(n) for n in gm.graph.nodes if n.op == "call_function"]


def test_a_tiled_blank_becomes_a_cat_that_computes_the_same_loss():
    torch.manual_seed(0)
    model = Filled(pieces=2)
    gm = capture(model, micro_batch=2, seq_len=16)
    assert to_cat_form(gm) == 1
    names = _names(gm)
    assert "copy_" not in names and "new_zeros" not in names and names.count("cat") == 1
    tokens, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    assert torch.equal(with_weights(gm, model)(tokens, targets), model(tokens, targets))


def test_a_blank_its_copies_do_not_tile_is_left():
    gm = capture(Filled(pieces=1), micro_batch=2, seq_len=16)
    assert to_cat_form(gm) == 0
    assert "copy_" in _names(gm) and "cat" not in _names(gm)
