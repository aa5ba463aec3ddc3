"""Capture gives a fused attention handed exactly the causal mask the causal kernel instead.

Each tiny attention (test_masks' `_Attention`, one kind of mask each) hands
scaled_dot_product_attention a mask built from constants, through both front
doors. Where the mask is the causal one and nothing else (True / 0 where the
key is at or before the query, False or a hiding fill after it) the captured
call asks `is_causal` and the mask's computation is gone; a window, a bias on the kept keys or a mask read from
the tokens stays as the model wrote it. Either way the graph, bound to the
model's weights, computes the model's logits: in float64 both kernels form
each output as the same softmax-weighted sum over at most S = 8 keys, so they
differ by float64 rounding (a few ulps times S); the bound 1e-12 of the
largest logit is ~4500 ulps, far below any masking mistake (which is O(1)).
"""

import pytest
import torch
from torch import nn

from ptc.compiler.capture import capture, with_weights
from ptc.compiler.graph.nodes import op_name
from ptc.compiler.graph.work import runs_causal_kernel
from tests.user_models import transformers_models
from tests.compiler.test_masks import _Attention

B, S = 2, 8
TOL = 1e-12


def _attentions(gm):
    return [n for n in gm.graph.nodes if op_name(n) == "scaled_dot_product_attention"]


def _mask(node):
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")


def _logits_match(gm, model: nn.Module) -> None:
    tokens = torch.randint(1, 32, (B, S), generator=torch.Generator().manual_seed(0))
    tokens[0, 2] = 0  # a padding token where the mask reads them
    with torch.no_grad():
        got, want = with_weights(gm, model)(tokens), model(tokens)
    assert float((got - want).abs().max()) <= TOL * float(want.abs().max())


@pytest.mark.parametrize("door", ["fx", "export"])
@pytest.mark.parametrize("kind", ["sdpa bool causal", "sdpa additive mask"])
def test_the_causal_mask_becomes_the_causal_kernel(kind: str, door: str) -> None:
    model = _Attention(kind).double()
    gm = capture(model, micro_batch=B, seq_len=S, dtype=torch.float64, with_loss=False,
                 front_door=door)
    (attention,) = _attentions(gm)
    assert _mask(attention) is None and attention.args[5] is True
    assert not any(op_name(n) in ("tril", "triu", "masked_fill") for n in gm.graph.nodes)
    assert runs_causal_kernel(gm)
    _logits_match(gm, model)


@pytest.mark.parametrize("door", ["fx", "export"])
@pytest.mark.parametrize("kind", ["sdpa window", "sdpa causal with a bias",
                                  "sdpa padding from the tokens"])
def test_any_other_mask_stays(kind: str, door: str) -> None:
    model = _Attention(kind).double()
    gm = capture(model, micro_batch=B, seq_len=S, dtype=torch.float64, with_loss=False,
                 front_door=door)
    (attention,) = _attentions(gm)
    assert _mask(attention) is not None
    assert not runs_causal_kernel(gm)
    _logits_match(gm, model)


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_hugging_face_attention_runs_the_causal_kernel(family: str) -> None:
    """transformers hands SDPA a [b, 1, s, s] mask built from positions: every attention
    captured asks is_causal instead, and the logits are the model's."""
    model = getattr(transformers_models, family)().double().eval()
    gm = capture(model, micro_batch=B, seq_len=S, dtype=torch.float64, with_loss=False)
    attentions = _attentions(gm)
    assert len(attentions) == model.config.num_hidden_layers
    assert all(_mask(a) is None and a.args[5] is True for a in attentions)
    tokens = torch.randint(0, 32, (B, S), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = with_weights(gm, model)(tokens), model(tokens).logits
    assert float((got - want).abs().max()) <= TOL * float(want.abs().max())
