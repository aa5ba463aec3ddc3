"""summarize / render_summary on captured models."""

import torch
from rich.console import Console

from ptc.compiler.capture import capture
from ptc.views.summary import format_summary, render_summary, summarize
from ptc.models import build_model
from ptc.plan import ModelSpec

B, S, H, A, V = 2, 16, 64, 4, 100
GPT = ModelSpec(family="gpt", layers=2, hidden=H, heads=A, vocab=V, max_seq=32)


def test_gpt2_parameters():
    spec = ModelSpec(family="gpt", layers=12, hidden=768, heads=12, vocab=50257, max_seq=1024)
    summary = summarize(capture(build_model(spec), micro_batch=1, seq_len=64, dtype="bf16"))
    assert summary.params == 124_439_808
    assert summary.param_bytes == 2 * 124_439_808
    assert summary.num_layers == 12 and summary.layers_identical


def test_gpt_flops_by_hand():
    summary = summarize(capture(build_model(GPT), micro_batch=B, seq_len=S))
    tokens = B * S
    layer_linear = 2 * tokens * (H * 3 * H + H * H + 2 * H * 4 * H)
    layer_attention = 4 * B * A * S * S * (H // A)
    assert summary.layer.linear_flops == layer_linear
    assert summary.layer.attention_flops == layer_attention
    head = 2 * tokens * H * V
    assert summary.matmul_flops_per_step == 2 * (layer_linear + layer_attention) + head
    assert summary.flops_per_step > summary.matmul_flops_per_step  # elementwise counted too
    assert summary.model_flops_per_step == 3 * summary.flops_per_step
    assert summary.flops_per_token == summary.flops_per_step / tokens
    assert summary.layer.linears == ("attn.qkv", "attn.o", "mlp.up", "mlp.down")
    assert summary.linears[-1] == "head" and len(summary.linears) == 9
    assert summary.attentions == ("layers.0.attn", "layers.1.attn")
    assert summary.embeddings == ("embed", "pos_embed")
    assert len(summary.norms) == 5


def test_render():
    summary = summarize(capture(build_model(GPT), micro_batch=B, seq_len=S))
    console = Console(width=160, record=True)
    console.print(render_summary(summary))
    text = console.export_text()
    assert "layers.*.attn.qkv" in text and "2 x layers" in text
    plain = format_summary(summary)
    assert "parameters" in plain and "model FLOPs" in plain
    assert isinstance(summary.dtype, torch.dtype)


def test_the_summary_says_which_attentions_run_the_causal_kernel_for_their_mask():
    """transformers hands SDPA a causal mask built from positions: capture gives each such
    attention the causal kernel, and the summary says how many (ptc's GPT has no mask)."""
    from tests.user_models.transformers_models import llama  # noqa: PLC0415

    summary = summarize(capture(llama(), micro_batch=B, seq_len=S))
    assert summary.causal_masks == 2 == len(summary.attentions)
    assert "; 2 handed exactly the causal mask run the causal kernel instead" in \
        format_summary(summary)
    plain = summarize(capture(build_model(GPT), micro_batch=B, seq_len=S))
    assert plain.causal_masks == 0 and "causal kernel" not in format_summary(plain)
