"""Causality: capture refuses a model whose attention lets a position see later tokens.

ptc trains next-token prediction, so such a model would learn to copy the token it is
asked to predict. `ptc.compiler.graph.masks` reads each attention's mask at the captured shape;
the cases below write the same tiny attention with each kind of mask, through both front
doors, and check what the mask hides against the causal mask itself.
"""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ptc.compiler.capture import capture
from ptc.compiler.graph.masks import MaskReader
from ptc.compiler.graph.nodes import attention_parts
from ptc.errors import CaptureError
from ptc.models import build_model
from ptc.plan import ModelSpec
from tests.user_models.hf_llama import hf_llama
from tests.user_models.nanogpt import nanogpt

B, S = 2, 8
LATER = torch.ones(S, S, dtype=torch.bool).triu(1)
"""What a causal attention hides: every key after the query."""


class _Attention(nn.Module):
    """Embedding, one 2-head attention written as `kind` says, head."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(32, 16)
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, 32)
        self.register_buffer("causal", torch.ones(S, S).tril())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        q, k, v = self.qkv(self.embed(tokens)).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        row = torch.ones_like(tokens[0], dtype=torch.bool)  # [s], traceable by both doors
        ones = row[:, None] & row[None, :]
        if self.kind == "sdpa causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.kind == "sdpa bidirectional":
            y = F.scaled_dot_product_attention(q, k, v)
        elif self.kind == "sdpa window":  # causal, each query sees its 3 latest keys
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=ones.tril() & ~ones.tril(-3))
        elif self.kind == "sdpa mask the wrong way":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=ones.triu())
        elif self.kind == "sdpa bool causal":  # transformers' shape, [b, 1, s, s]
            y = F.scaled_dot_product_attention(q, k, v,
                                               attn_mask=ones.tril()[None, None].expand(b, 1, s, s))
        elif self.kind == "sdpa causal with a bias":  # the kept keys get 0.5 added
            biased = torch.full_like(ones, 0.5, dtype=q.dtype).masked_fill(ones.triu(1), -1e9)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=biased)
        elif self.kind == "sdpa additive mask":
            future = torch.zeros_like(ones, dtype=q.dtype).masked_fill(ones.triu(1), -1e9)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=future)
        elif self.kind == "sdpa padding from the tokens":  # values read: not judged
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=(tokens != 0)[:, None, None])
        else:
            scores = q @ k.transpose(-2, -1) * 8 ** -0.5
            if self.kind == "written causal":
                scores = scores.masked_fill(ones.triu(1), float("-inf"))
            elif self.kind == "written causal buffer":  # nanoGPT's way
                scores = scores.masked_fill(self.causal[:s, :s] == 0, float("-inf"))
            elif self.kind == "written where causal":  # GPT-Neo's way
                scores = torch.where(ones.tril(), scores, -3.4e38)
            elif self.kind == "written where the wrong way":
                scores = torch.where(ones.triu(), scores, -3.4e38)
            elif self.kind == "written added mask":  # Hugging Face's eager way
                scores = scores + torch.zeros_like(ones, dtype=scores.dtype).masked_fill(
                    ones.triu(1), -3.4e38)
            elif self.kind != "written unmasked":
                raise ValueError(self.kind)
            y = torch.softmax(scores, dim=-1) @ v
        return self.head(y.transpose(1, 2).reshape(b, s, 16))


CAUSAL = ["sdpa causal", "sdpa window", "sdpa additive mask", "sdpa bool causal",
          "sdpa causal with a bias", "written causal",
          "written causal buffer", "written added mask", "written where causal"]
SEES_LATER = {"sdpa bidirectional": "it hides no key from any query",
              "sdpa mask the wrong way": "its mask lets a query see a later key",
              "written where the wrong way": "its mask lets a query see a later key",
              "written unmasked": "it hides no key from any query"}


def _attention(gm):
    return next(n for n in gm.graph.nodes if attention_parts(n) is not None)


@pytest.mark.parametrize("door", ["fx", "export"])
@pytest.mark.parametrize("kind", CAUSAL)
def test_a_causal_mask_is_read_and_the_model_is_captured(kind: str, door: str) -> None:
    model = _Attention(kind)
    gm = capture(model, micro_batch=B, seq_len=S, front_door=door)
    hidden = MaskReader(dict(model.named_buffers())).hidden_keys(_attention(gm))
    assert hidden is not None, "the mask is built from constants: it must be judged"
    assert bool((hidden | ~LATER).all()), "every later key is hidden"
    if kind == "sdpa window":
        assert int((~hidden.reshape(-1, S, S)[0, -1]).sum()) == 3  # the last query sees 3
    else:
        assert torch.equal(hidden.expand(B, 2, S, S)[0, 0], LATER)


@pytest.mark.parametrize("door", ["fx", "export"])
@pytest.mark.parametrize("kind", sorted(SEES_LATER))
def test_attention_that_sees_later_tokens_is_refused_naming_it(kind: str, door: str) -> None:
    with pytest.raises(CaptureError) as refused:
        capture(_Attention(kind), micro_batch=B, seq_len=S, front_door=door)
    message = str(refused.value)
    assert message.startswith("_Attention is not a causal language model: the attention at ")
    assert SEES_LATER[kind] in message
    assert "test_masks.py:" in message  # the user's line
    assert "\n" not in message


@pytest.mark.parametrize("kind", sorted(SEES_LATER))
def test_without_a_loss_the_logits_of_any_model_are_captured(kind: str) -> None:
    """Only training (a graph with its loss) needs next-token causality."""
    capture(_Attention(kind), micro_batch=B, seq_len=S, with_loss=False)


def test_a_mask_read_from_the_tokens_is_not_judged() -> None:
    model = _Attention("sdpa padding from the tokens")
    gm = capture(model, micro_batch=B, seq_len=S)
    assert MaskReader().hidden_keys(_attention(gm)) is None


def test_a_mask_buffer_ptc_holds_only_on_meta_is_not_judged_without_the_model() -> None:
    model = _Attention("written causal buffer")
    gm = capture(model, micro_batch=B, seq_len=S, front_door="fx")
    assert MaskReader().hidden_keys(_attention(gm)) is None
    buffers = dict(model.named_buffers())
    assert MaskReader(buffers).hidden_keys(_attention(gm)) is not None


@pytest.mark.parametrize("model", [
    build_model(ModelSpec(family="gpt", layers=1, hidden=16, heads=2, vocab=32, max_seq=S)),
    build_model(ModelSpec(family="llama", layers=1, hidden=16, heads=2, kv_heads=1, ffn=32,
                          vocab=32, max_seq=S)),
    nanogpt(n_layer=1, n_head=2, n_embd=16, vocab_size=32, block_size=S),
    hf_llama(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=S),
], ids=["gpt", "llama", "nanogpt", "hf_llama eager"])
def test_the_models_ptc_trains_are_judged_causal(model: nn.Module) -> None:
    gm = capture(model, micro_batch=B, seq_len=S)
    hidden = MaskReader(dict(model.named_buffers())).hidden_keys(_attention(gm))
    assert hidden is not None
    assert torch.equal(hidden.reshape(-1, S, S)[0], LATER)


def test_a_bidirectional_hugging_face_encoder_is_refused() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     max_position_embeddings=S)
    with pytest.raises(CaptureError, match=r"BertForMaskedLM is not a causal language model: "
                                           r"the attention at .* in module 'bert\.encoder"):
        capture(transformers.BertForMaskedLM(config), micro_batch=B, seq_len=S)


def test_identical_layers_have_their_mask_evaluated_once(monkeypatch) -> None:
    """Each layer of ptc's GPT builds its own causal mask (ones_like(scores).triu(1)): the
    reader evaluates the first and answers the other three from it."""
    evaluated = []
    evaluate_all = MaskReader._evaluate_all
    monkeypatch.setattr(MaskReader, "_evaluate_all",
                        lambda self, node: evaluated.append(node) or evaluate_all(self, node))
    model = build_model(ModelSpec(family="gpt", layers=4, hidden=16, heads=2, vocab=32,
                                  max_seq=S))
    gm = capture(model, micro_batch=B, seq_len=S)  # its own check: one evaluation too
    assert len(evaluated) == 1
    evaluated.clear()
    attentions = [n for n in gm.graph.nodes if attention_parts(n) is not None]
    reader = MaskReader()
    assert [reader.later_keys_seen(n) for n in attentions] == [None] * 4
    assert len(evaluated) == 1
