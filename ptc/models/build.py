"""`build_model`: a ModelSpec -> an nn.Module, on the meta device or materialised.

Built-in families are constructed on the meta device first (free at any
size), then, when asked for a real device, allocated with `to_empty` and
filled by `init_weights`, so the values never depend on torch's global RNG.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch
from torch import nn

from ptc.errors import PtcError
from ptc.models.gpt import GPT
from ptc.models.init import init_weights
from ptc.models.llama import Llama
from ptc.plan import ModelSpec

FAMILIES: dict[str, type[nn.Module]] = {"gpt": GPT, "llama": Llama}


def build_model(spec: ModelSpec, device: str | torch.device = "meta", seed: int = 0) -> nn.Module:
    """Build the model a spec describes.

    On "meta" nothing is allocated. On another device the built-in families
    get the deterministic weights of `ptc.models.init` (from `seed`); a
    custom factory is called under `torch.manual_seed(seed)` (its own init,
    made repeatable) with torch's default device set to `device`.
    """
    device = torch.device(device)
    if spec.family == "custom":
        return _build_custom(spec, device, seed)
    cls = FAMILIES[spec.family]
    with torch.device("meta"):
        model = cls(spec)
    if device.type == "meta":
        return model
    # to_empty replaces each module's parameter objects, which unties shared
    # ones; the model re-ties before weights are filled.
    model.to_empty(device="cpu")
    model.tie_weights()
    init_weights(model, seed)
    return model.to(device)


def resolve_factory(factory: str):
    """Import "package.module:callable" and return the callable (PtcError if it fails).

    The module is looked up as `python -m` would, the working directory first, so a plan's
    factory imports the same from the `ptc` command as from the workers it starts.
    """
    module_name, _, attr = factory.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or an error raised by the module itself
        raise PtcError(f"model factory {factory!r}: cannot import {module_name!r}: "
                       f"{type(exc).__name__}: {exc}") from exc
    target = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise PtcError(f"model factory {factory!r}: module {module_name!r} has no "
                           f"attribute {attr!r}") from exc
    if not callable(target):
        raise PtcError(f"model factory {factory!r}: {attr!r} is not callable")
    return target


def _build_custom(spec: ModelSpec, device: torch.device, seed: int) -> nn.Module:
    fn = resolve_factory(spec.factory)
    kwargs = dict(spec.kwargs)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            with device:
                model = fn(**kwargs)
    except Exception as exc:
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise PtcError(f"model factory {spec.factory!r} failed when called as "
                       f"{spec.factory.partition(':')[2]}({args}): "
                       f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise PtcError(f"model factory {spec.factory!r} returned "
                       f"{type(model).__name__}, not an nn.Module")
    return model
