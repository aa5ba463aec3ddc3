"""Linears written as matrix products (GPT-2's Conv1D, `x @ W`) become F.linear, values unchanged.

`to_linear_form` runs at the start of the tensor_parallel pass; here it runs
alone on captured graphs, which are then executed with real weights to show
that the rewrite computes what the module does. Which weight dimension holds
the output features (`linear_out_dim`) decides how tensor parallelism splits
the stored weight.
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
from ptc.compiler.graph.nodes import linear_out_dim, linear_weight, op_name  # noqa: E402
from ptc.passes.linear_form import to_linear_form  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class Conv1DStyle(nn.Module):
    """GPT-2's Conv1D: a weight stored [in, out], applied with addmm on flattened rows."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out) / d_in ** 0.5)
        self.bias = nn.Parameter(torch.randn(d_out))

    def forward(self, x):
        shape = x.size()[:-1] + (self.weight.size(1),)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(shape)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.up = Conv1DStyle(32, 64)
        self.down = nn.Parameter(torch.randn(64, 32) / 8)  # used as x @ W
        self.head = nn.Linear(32, 64)

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        h = h + F.gelu(self.up(h)) @ self.down
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def _captured():
    torch.manual_seed(0)
    model = Model()
    gm = capture(model, micro_batch=2, seq_len=16)
    return model, gm


def test_products_become_linears_that_compute_the_same_loss():
    model, gm = _captured()
    assert to_linear_form(gm) == 2
    names = [op_name(n) for n in gm.graph.nodes if n.op == "call_function"]
    assert "addmm" not in names and "matmul" not in names and names.count("linear") == 2
    linears = [n for n in gm.graph.nodes if op_name(n) == "linear" and n.op == "call_function"]
    assert [linear_out_dim(n) for n in linears] == [1, 1]  # both weights stored [in, out]
    tokens = torch.randint(0, 64, (2, 16))
    targets = torch.randint(0, 64, (2, 16))
    # The same products on the same operands: the loss is the module's to the last bit.
    assert torch.equal(with_weights(gm, model)(tokens, targets), model(tokens, targets))


def test_the_flatten_and_unflatten_around_conv1d_are_gone():
    _, gm = _captured()
    to_linear_form(gm)
    up = next(n for n in gm.graph.nodes if op_name(n) == "linear")
    assert up.args[0].op == "call_module"  # the embedding: reads its [b, s, h] output directly
    assert all(op_name(u) not in ("view", "reshape") for u in up.users)


class TransposedStyle(nn.Module):
    """Falcon's linear: a weight stored [out, in], applied as `x @ w.T`, through the export
    door (torch.finfo stops symbolic tracing), where `w.T` is aten's numpy_T."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.up = nn.Parameter(torch.randn(48, 32) / 32 ** 0.5)
        self.head = nn.Linear(32 + 48, 64)

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        torch.finfo(h.dtype)
        h = torch.cat([h, F.gelu(h @ self.up.T)], dim=-1)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def test_a_product_with_a_transposed_weight_is_a_linear_of_the_stored_weight():
    torch.manual_seed(0)
    model = TransposedStyle()
    gm = capture(model, micro_batch=2, seq_len=16)
    assert to_linear_form(gm) == 1
    up = next(n for n in gm.graph.nodes if n.op == "call_function" and linear_weight(n) == "up")
    assert linear_out_dim(up) == 0  # stored [out, in]: tp splits its rows for a colwise split
    tokens = torch.randint(0, 64, (2, 16))
    targets = torch.randint(0, 64, (2, 16))
    assert torch.equal(with_weights(gm, model)(tokens, targets), model(tokens, targets))
