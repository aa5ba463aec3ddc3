"""The call rule: how capture calls the model's forward.

Terms: the *tokens* parameter is forward's first parameter; it receives
tokens[b, s] (int64). The *targets* parameter is the first later one named
`targets`, `target` or `y`; it receives the targets (the next token of
every position) whenever the model has one — even without a loss —
because models such as nanoGPT compute full-sequence logits only when
given targets. `labels` is not one: by transformers' convention a model
shifts its labels itself (labels = input_ids), so the targets ptc passes
would be shifted twice and train the token after next; it stays None, and
ptc's own next-token loss is appended to the logits. Every other
parameter is *concrete*: fixed to a value for the whole capture —
`use_cache`, `output_attentions`, `output_hidden_states` to False, any
other to its default (e.g. `attention_mask=None`, `past_key_values=None`,
`labels=None`). A parameter without default is an error. A forward that
takes these flags only through `**kwargs` (GraniteMoE's) is still given
those its model's `config` defines: otherwise it would return its key/value
cache with the logits.

Job: read forward's signature into a `CallRule`; nothing here traces.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from torch import nn

from ptc.errors import CaptureError

TARGET_NAMES = ("targets", "target", "y")
FLAG_OVERRIDES = {"use_cache": False, "output_attentions": False,
                  "output_hidden_states": False}


@dataclass
class CallRule:
    """How forward is called: the names of its tokens and targets parameters."""

    tokens: str
    targets: str | None
    concrete: dict = field(default_factory=dict)
    """Every other forward parameter, with the value it is fixed to."""


def call_rule(model: nn.Module) -> CallRule:
    """The CallRule of `model.forward` (see the module docstring).

    Read once, before either front door opens, so that both call forward
    alike; raises CaptureError when forward takes nothing or needs an
    argument capture cannot supply.
    """
    signature = inspect.signature(model.forward).parameters.values()
    params = [p for p in signature if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not params:
        raise CaptureError(f"{type(model).__name__}.forward takes no argument; capture "
                           "calls forward(tokens[b, s]) (and targets, if it takes them)")
    targets = next((p.name for p in params[1:] if p.name in TARGET_NAMES), None)
    concrete = {}
    for p in params[1:]:
        if p.name == targets:
            continue
        if p.name in FLAG_OVERRIDES:
            concrete[p.name] = FLAG_OVERRIDES[p.name]
        elif p.default is not p.empty:
            concrete[p.name] = p.default
        else:
            raise CaptureError(
                f"{type(model).__name__}.forward needs argument {p.name!r}, which capture "
                f"cannot supply: it calls forward(tokens[, {'/'.join(TARGET_NAMES)}]). "
                f"Give {p.name!r} a default, or wrap the model in a module whose forward "
                "takes tokens")
    if any(p.kind == p.VAR_KEYWORD for p in signature):
        config = getattr(model, "config", None)
        concrete |= {name: value for name, value in FLAG_OVERRIDES.items()
                     if name not in concrete and hasattr(config, name)}
    return CallRule(params[0].name, targets, concrete)
