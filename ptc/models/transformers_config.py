"""A Hugging Face transformers model rebuilt from its config.

`ptc.compile(model, mesh)` names `from_config` as the plan's factory for a transformers
module, with the module's class and config, so ptc prices the architecture it was given;
the module itself, with its weights, is what trains.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ptc.errors import PtcError


def from_config(architecture: str, **config: Any) -> nn.Module:
    """A fresh `transformers.<architecture>` built from `config` (`config.to_dict()`)."""
    import transformers  # noqa: PLC0415 - only plans of transformers models need it

    cls = getattr(transformers, architecture, None)
    if cls is None or not hasattr(cls, "config_class"):
        raise PtcError(f"transformers has no model class {architecture!r}")
    return cls(cls.config_class.from_dict(config))


def factory_of(model: nn.Module) -> tuple[str, dict[str, Any]] | None:
    """(factory, kwargs) that rebuild `model`'s architecture, for a model of a class
    transformers exports; None for any other module."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    if config is None or not hasattr(config, "to_dict") \
            or not type(model).__module__.startswith("transformers."):
        return None
    import transformers  # noqa: PLC0415

    if getattr(transformers, name, None) is not type(model):
        return None
    return f"{__name__}:from_config", {"architecture": name, **config.to_dict()}
