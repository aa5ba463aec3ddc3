"""Deterministic initial weights that do not depend on the parallel layout.

Every parameter gets its own CPU `torch.Generator`, seeded from the run seed
and the parameter's full name. A rank that holds only some layers, or only a
shard of a weight, therefore computes exactly the values the full model on
one process would: it builds the full tensor of the parameters it needs with
`initial_value` and slices it. The rule is GPT-2/Llama's: normal(0, 0.02)
for Linear and Embedding weights, 0.02/sqrt(2·layers) for the two residual
projections of each block (`attn.o`, `mlp.down`; GPT-2's scaled init), zero
biases, unit norm weights.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

STD = 0.02
RESIDUAL_PROJECTIONS = ("attn.o.weight", "mlp.down.weight")


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed for parameter `name`, stable across processes and runs."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _num_layers(model: nn.Module) -> int:
    spec = getattr(model, "spec", None)
    return getattr(spec, "layers", None) or 1


def initial_value(model: nn.Module, name: str, seed: int) -> torch.Tensor:
    """The full fp32 CPU tensor parameter `name` of `model` starts from.

    Works on a meta model: only the name, shape and owning module are read.
    """
    param = model.get_parameter(name)
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    shape = tuple(param.shape)
    if isinstance(owner, (nn.LayerNorm, nn.RMSNorm)) and leaf == "weight":
        return torch.ones(shape)
    if leaf == "bias":
        return torch.zeros(shape)
    std = STD
    if name.endswith(RESIDUAL_PROJECTIONS):
        std = STD / math.sqrt(2 * _num_layers(model))
    gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def init_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter of a materialised model, and recompute its buffers.

    Tied parameters are filled once, under their first name (`embed.weight`).
    Modules with a `reset_buffers()` method (RoPE tables) recompute theirs.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():  # de-duplicates tied weights
            param.copy_(initial_value(model, name, seed))
        for module in model.modules():
            reset = getattr(module, "reset_buffers", None)
            if callable(reset):
                reset()
