"""Predicted saved-activation bytes equal what torch really saves, on this CPU, fp32 and bf16.

Measured with `torch.autograd.graph.saved_tensors_hooks` on a real forward
pass: every saved tensor's storage counted once (views of one storage share
it), parameters and buffers left out (they are model state). The one known
difference from a GPU run is `cpu_statistics_gap`: the model predicts what
CUDA's kernels keep.

Dropout: the eager model's `nn.Dropout` is torch's, which off CUDA keeps a
mask in the activation dtype; what ptc runs is the captured graph with
keyed dropout (`ptc.ops.dropout`), which keeps a 1-byte mask on every
device, as the model predicts (`test_keyed_dropout_keeps_what_the_model_predicts`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repo root on the path
    sys.path.insert(0, str(ROOT))

from ptc.compiler.capture import capture, with_weights  # noqa: E402
from ptc.compiler.records.layout import Layout  # noqa: E402
from ptc.compiler.memory.model import precision, stage_memory  # noqa: E402
from ptc.compiler.profile.types import DTYPES  # noqa: E402
from ptc.compiler.profile.cache import model_profile  # noqa: E402
from ptc.models import build_model  # noqa: E402
from ptc.ops.dropout import Samples, dropout_samples  # noqa: E402
from ptc.plan import ModelSpec  # noqa: E402
from tests.memory.measure import as_runtime_holds  # noqa: E402

SPECS = {
    "gpt": ModelSpec(family="gpt", layers=3, hidden=96, heads=4, vocab=256, max_seq=64),
    "gpt-untied": ModelSpec(family="gpt", layers=2, hidden=64, heads=2, vocab=200, max_seq=64,
                            tied_embeddings=False),
    "llama": ModelSpec(family="llama", layers=3, hidden=96, heads=6, kv_heads=2, ffn=256,
                       vocab=256, max_seq=64),
}


def saved_bytes(module: torch.nn.Module, loss_of: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves while `loss_of()` runs forward and loss,
    less `module`'s parameters and buffers (model state)."""
    state = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in state:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of()
    loss.backward()  # the graph (and so every saved storage) lived until here
    return sum(saved.values())


def measured_saved_bytes(model: torch.nn.Module, tokens: torch.Tensor,
                         targets: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward + loss, the
    loss as ptc appends it: on the logits' float32 copy."""
    return saved_bytes(model, lambda: F.cross_entropy(model(tokens).flatten(0, 1).float(),
                                                      targets.flatten()))


def cpu_statistics_gap(norms: int, tokens: int, dtype: torch.dtype) -> int:
    """Bytes a CPU run saves less than the model predicts, for `norms` LayerNorms whose
    statistics backward keeps over `tokens` tokens: CPU's LayerNorm keeps its mean and rstd
    (one each per token) in the input's dtype, CUDA's kernel — and the meta kernel the
    profile runs — in fp32. Zero in fp32; 4 bytes per token and norm in bf16 (under 0.3 %
    of a GPT's activations here)."""
    return norms * tokens * 2 * (4 - dtype.itemsize)


def predicted_activations(spec: ModelSpec, dtype: str, b: int, s: int) -> float:
    """The memory model's activation bytes of `spec`, one micro-batch, no parallelism."""
    layout = Layout(tp=1, pp=1, dp=1, vstages=1, micro_batch=b, microbatches=1, zero=0, sp=False,
                    schedule="1f1b", layers=spec.layers, checkpoint="none", overlap=True)
    prec = precision(DTYPES[dtype].itemsize, "adamw")
    return stage_memory(model_profile(spec, dtype), layout, prec, s)[0]["activations"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("b, s", [(1, 32), (3, 48)])
def test_activation_bytes_match_the_measurement(name, b, s, dtype):
    spec = SPECS[name]
    torch.manual_seed(0)
    model = as_runtime_holds(build_model(spec, device="cpu"), DTYPES[dtype])
    tokens, targets = torch.randint(0, spec.vocab, (2, b, s))
    measured = measured_saved_bytes(model, tokens, targets)
    norms = sum(isinstance(m, nn.LayerNorm) for m in model.modules())
    gap = cpu_statistics_gap(norms, b * s, DTYPES[dtype])
    assert predicted_activations(spec, dtype, b, s) == measured + gap


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_keyed_dropout_keeps_what_the_model_predicts(dtype):
    """GPT with dropout 0.1 run as ptc runs it (the captured graph, masks keyed by sample):
    1-byte masks, as predicted, not torch's CPU masks in the activation dtype."""
    spec = dataclasses.replace(SPECS["gpt"], dropout=0.1)
    b, s = 2, 32
    model = as_runtime_holds(build_model(spec, device="cpu", seed=0), DTYPES[dtype])
    gm = with_weights(capture(model, micro_batch=b, seq_len=s, dtype=DTYPES[dtype]), model)
    tokens, targets = torch.randint(0, spec.vocab, (2, b, s))
    with dropout_samples(Samples(seed=0, first=0)):
        measured = saved_bytes(gm, lambda: gm(tokens, targets))
    norms = sum(isinstance(m, nn.LayerNorm) for m in model.modules())
    gap = cpu_statistics_gap(norms, b * s, DTYPES[dtype])
    assert predicted_activations(spec, dtype, b, s) == measured + gap


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("factory, s", [("gpt_oss", 16), ("gpt_neo", 12)])
def test_transformers_attention_forms_keep_what_the_model_predicts(factory, s, dtype):
    """transformers models run as ptc runs them (the captured graph): GPT-OSS, whose
    written-out attention joins per-head sink logits to the scores and drops their column
    after the softmax, its experts grouped products behind a top-2 router; GPT-Neo, whose
    attention masks the scores with where(causal, scores, fill), the fill a tensor its
    forward makes (export lifts it as a constant). What autograd saves is what the profile
    of the model counts, less CPU's LayerNorm statistics (`cpu_statistics_gap`; GPT-OSS
    has RMSNorms)."""
    spec = ModelSpec(family="custom", factory=f"tests.user_models.transformers_models:{factory}",
                     max_seq=16)
    b = 2
    model = as_runtime_holds(build_model(spec, device="cpu", seed=0), DTYPES[dtype])
    gm = with_weights(capture(model, micro_batch=b, seq_len=s, dtype=DTYPES[dtype]), model)
    tokens, targets = torch.randint(0, model.config.vocab_size, (2, b, s))
    measured = saved_bytes(gm, lambda: gm(tokens, targets))
    norms = sum(isinstance(m, nn.LayerNorm) for m in model.modules())
    gap = cpu_statistics_gap(norms, b * s, DTYPES[dtype])
    layers = model.config.num_hidden_layers
    assert predicted_activations(dataclasses.replace(spec, layers=layers), dtype, b, s) \
        == measured + gap


def test_measurement_sees_dropout_masks():
    """The measuring hook itself: a dropout layer adds its mask's bytes."""
    spec = SPECS["gpt"]
    tokens, targets = torch.randint(0, spec.vocab, (2, 2, 16))
    plain = measured_saved_bytes(build_model(spec, device="cpu"), tokens, targets)
    noisy = measured_saved_bytes(build_model(dataclasses.replace(spec, dropout=0.1),
                                             device="cpu"), tokens, targets)
    assert noisy > plain
