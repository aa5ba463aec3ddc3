"""Where the profile gets the model it profiles: a source handed down from above.

The compiler never imports the model zoo (`ptc.models`): a profile is read
off the graph of whatever model a plan's `model` section names, and what
builds it is handed down. `ModelSource` is that pair of functions: build a
spec's model on a device, and find the callable a custom spec's factory
names (whose source file keys the profile cache). The package's top
(`ptc/__init__.py`) hands down the zoo's own when ptc is imported
(`use_models`); a caller may hand down another.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ptc.errors import CompileError

if TYPE_CHECKING:
    from torch import nn

    from ptc.plan import ModelSpec


@dataclass(frozen=True, slots=True)
class ModelSource:
    """How to build the model of a spec, and to resolve a custom spec's factory."""

    build: Callable[[ModelSpec, str], nn.Module]
    """(spec, device) -> the spec's model on that device ("meta" when profiling)."""
    factory: Callable[[str], Any]
    """"package.module:callable" -> that callable (PtcError when it cannot be imported)."""


_SOURCE: list[ModelSource] = []


def use_models(source: ModelSource) -> None:
    """Hand down what builds the models profiled from now on (replacing any before)."""
    _SOURCE[:] = [source]


def model_source() -> ModelSource:
    """The source handed down; CompileError when none was."""
    if not _SOURCE:
        raise CompileError("no model source was handed to the compiler's profiles "
                           "(ptc.compiler.profile.models.use_models)")
    return _SOURCE[0]
