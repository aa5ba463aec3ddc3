"""Giving a graph module's parameters the shapes one rank holds (the tensor_parallel and
expert_parallel passes): every name of a tied parameter at once."""

from __future__ import annotations

import torch
from torch import fx, nn


def param_aliases(gm: fx.GraphModule) -> dict[str, list[str]]:
    """Parameter name -> every name of the same parameter (tied weights)."""
    by_id: dict[int, list[str]] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {name: names for names in by_id.values() for name in names}


def set_local_param(gm: fx.GraphModule, names: list[str], shape: tuple[int, ...]) -> None:
    """Replace a parameter (under all its names) by an empty meta one of `shape`."""
    old = gm.get_parameter(names[0])
    new = nn.Parameter(torch.empty(shape, dtype=old.dtype, device="meta"),
                       requires_grad=old.requires_grad)
    for name in names:
        owner, _, leaf = name.rpartition(".")
        (gm.get_submodule(owner) if owner else gm)._parameters[leaf] = new
