"""Built-in model families (gpt, llama) as plain nn.Modules, and `build_model`."""

from ptc.models.build import FAMILIES, build_model, resolve_factory
from ptc.models.gpt import GPT
from ptc.models.init import init_weights, initial_value, param_seed
from ptc.models.llama import Llama

__all__ = ["FAMILIES", "GPT", "Llama", "build_model", "count_parameters", "init_weights",
           "initial_value", "param_seed", "resolve_factory"]


def count_parameters(model) -> int:
    """Number of parameter elements, each shared (tied) parameter counted once."""
    return sum(p.numel() for p in model.parameters())
