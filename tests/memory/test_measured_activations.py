"""Predicted saved-activation bytes agree with what torch really saves, on this CPU.

Measured with `torch.autograd.graph.saved_tensors_hooks` on a real forward
pass: every saved tensor's storage counted once (views of one storage share
it), parameters and buffers left out (they are model state). Dropout is off:
off CUDA torch keeps dropout masks in the activation dtype, while the model
predicts CUDA's 1-byte masks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn import functional as F

from ptc.compiler.layout import Layout
from ptc.compiler.memory import precision, stage_memory
from ptc.compiler.profile import model_profile
from ptc.models import build_model
from ptc.plan import ModelSpec

SPECS = {
    "gpt": ModelSpec(family="gpt", layers=3, hidden=96, heads=4, vocab=256, max_seq=64),
    "gpt-untied": ModelSpec(family="gpt", layers=2, hidden=64, heads=2, vocab=200, max_seq=64,
                            tied_embeddings=False),
    "llama": ModelSpec(family="llama", layers=3, hidden=96, heads=6, kv_heads=2, ffn=256,
                       vocab=256, max_seq=64),
}


def measured_saved_bytes(model: torch.nn.Module, tokens: torch.Tensor,
                         targets: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward + loss."""
    state = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in state:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()  # the graph (and so every saved storage) lived until here
    return sum(saved.values())


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("b, s", [(1, 32), (3, 48)])
def test_activation_bytes_within_two_percent(name, b, s):
    spec = SPECS[name]
    torch.manual_seed(0)
    model = build_model(spec, device="cpu")
    tokens, targets = torch.randint(0, spec.vocab, (2, b, s))
    measured = measured_saved_bytes(model, tokens, targets)
    layout = Layout(tp=1, pp=1, dp=1, vstages=1, micro_batch=b, microbatches=1, zero=0, sp=False,
                    schedule="1f1b", layers=spec.layers, checkpoint="none", overlap=True)
    predicted = stage_memory(model_profile(spec, "fp32"), layout, precision(4, "adamw"), s)[0]
    assert predicted["activations"] == pytest.approx(measured, rel=0.02)


def test_measurement_sees_dropout_masks():
    """The measuring hook itself: a dropout layer adds its mask's bytes."""
    spec = SPECS["gpt"]
    tokens, targets = torch.randint(0, spec.vocab, (2, 2, 16))
    plain = measured_saved_bytes(build_model(spec, device="cpu"), tokens, targets)
    noisy = measured_saved_bytes(build_model(dataclasses.replace(spec, dropout=0.1),
                                             device="cpu"), tokens, targets)
    assert noisy > plain
