"""The graph-derived activation memory reproduces Korthikanti et al.'s per-layer formulas.

The textbook layer is our GPT with dropout (written-out attention, 1-byte
dropout masks, 16-bit activations). Its graph-derived per-layer bytes equal
the published table exactly, plus two terms the table leaves out and the
graph sees: the norms' fp32 mean and rstd (2 norms x 2 x 4 bytes per token)
and the s x s causal mask (one byte per entry, per rank).
"""

from __future__ import annotations

import pytest
import sympy

from ptc.compiler.memory.model import layer_activations, t
from ptc.compiler.profile.types import b, s
from ptc.compiler.profile.cache import model_profile
from ptc.plan import ModelSpec


@pytest.fixture(scope="module", params=[(64, 4), (96, 6)], ids=["h64a4", "h96a6"])
def textbook(request):
    h, a = request.param
    spec = ModelSpec(family="gpt", layers=2, hidden=h, heads=a, vocab=128, max_seq=64,
                     dropout=0.1)
    return model_profile(spec, "bf16"), h, a


NORM_STATS = 16 * b * s
MASK = s**2


def _same(derived, expected):
    assert sympy.simplify(derived - expected) == 0, sympy.expand(derived - expected)


def test_no_parallelism(textbook):
    profile, h, a = textbook
    derived = layer_activations(profile, "none", sp=False).subs(t, 1)
    _same(derived, s * b * h * (34 + sympy.Rational(5 * a) * s / h) + NORM_STATS + MASK)


def test_tensor_parallel(textbook):
    profile, h, a = textbook
    expected = s * b * h * (10 + 24 / t + sympy.Rational(5 * a) * s / (h * t))
    _same(layer_activations(profile, "none", sp=False), expected + NORM_STATS + MASK)


def test_tensor_and_sequence_parallel(textbook):
    profile, h, a = textbook
    expected = s * b * h / t * (34 + sympy.Rational(5 * a) * s / h)
    _same(layer_activations(profile, "none", sp=True), expected + NORM_STATS / t + MASK)


def test_selective_recompute_with_sp(textbook):
    profile, h, _ = textbook
    # The mask is made inside the attention core, so selective recompute drops it too.
    _same(layer_activations(profile, "selective", sp=True), 34 * s * b * h / t + NORM_STATS / t)


def test_full_recompute_keeps_the_layer_input(textbook):
    profile, h, _ = textbook
    _same(layer_activations(profile, "full", sp=False), 2 * s * b * h)
    _same(layer_activations(profile, "full", sp=True), 2 * s * b * h / t)


@pytest.mark.parametrize("dtype, width", [("fp32", 4), ("bf16", 2)])
def test_full_recompute_keeps_the_input_no_node_saves(dtype, width):
    """Llama's RMSNorm saves an fp32 copy of a bf16 input, not the input, which a fully
    recomputed layer's checkpoint keeps all the same."""
    spec = ModelSpec(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=160,
                     vocab=128, max_seq=64)
    profile = model_profile(spec, dtype)
    _same(layer_activations(profile, "full", sp=False), width * s * b * 64)
    _same(layer_activations(profile, "full", sp=True), width * s * b * 64 / t)


def test_flash_attention_has_no_quadratic_term():
    spec = ModelSpec(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=160,
                     vocab=128, max_seq=64)
    derived = layer_activations(model_profile(spec, "bf16"), "none", sp=False)
    assert sympy.degree(derived, s) == 1
