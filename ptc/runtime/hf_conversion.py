"""transformers' own checkpoint conversion, applied by name to a save_pretrained directory.

transformers 5 holds some parameters in another layout than the one `save_pretrained`
writes: a mixture of experts keeps each layer's experts stacked
(`model.layers.0.mlp.experts.gate_up_proj`, [E, 2F, H]) but saves them one expert at a
time in the hub's layout (Mixtral: `...block_sparse_moe.experts.{e}.w1.weight`, `w3`,
`w2`; Qwen-MoE, OLMoE, DeepSeek-V3: `...mlp.experts.{e}.gate_proj.weight`, `up_proj`,
`down_proj`), and `from_pretrained` converts them back on load by rules registered per
model type. This module applies those very rules, so that the reader
(`ptc.runtime.hf_weights.SafetensorsState`) presents the module's own names:

- `conversion_rules`: the rules for a directory's config.json, looked up as transformers
  looks them up for a model (its class, `architectures`, first, then its `model_type`),
  plus the legacy renamings `from_pretrained` always adds;
- `ConvertedNames`: each module name and how it is made from the file's tensors: one
  tensor renamed, or several gathered by a converter (every expert of a layer), grouped
  as `from_pretrained` groups them;
- `convert`: a converted tensor, by the converter's own operations (stack, concatenate,
  ...), from tensors read when it is asked for, or from meta tensors for its shape alone.

transformers' API for this is not a public one; each use of it is in one small function
below whose docstring names what it relies on. Without transformers (or for a model
type it has no rules for) the names are the file's, as saved.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def conversion_rules(config: dict) -> list | None:
    """transformers' weight transforms for a checkpoint whose config.json is `config`, in
    the order `from_pretrained` applies them; None when there are none to apply (no
    transformers, or a model type without rules).

    Relies on `transformers.conversion_mapping.get_checkpoint_conversion_mapping(name)`,
    looked up as `extract_weight_conversions_for_model` does (the class name, here each
    of config.json's `architectures`, before `model_type`), and on the `"legacy"` entry
    that `get_model_conversion_mapping(add_legacy=True)` appends. A composite model's
    sub-models, whose rules transformers scopes to their prefix, are not looked up: only
    the root model's rules apply."""
    try:
        from transformers.conversion_mapping import (  # noqa: PLC0415 - heavy, optional
            get_checkpoint_conversion_mapping)
    except ImportError:
        return None
    rules = None
    for name in (*(config.get("architectures") or ()), config.get("model_type")):
        if isinstance(name, str) and name:
            rules = get_checkpoint_conversion_mapping(name)
            if rules is not None:
                break
    if not rules:
        return None
    return list(rules) + list(get_checkpoint_conversion_mapping("legacy") or ())


def _split_rules(rules: list) -> tuple[list, list]:
    """The renamings and the converters among `rules` (`transformers.core_model_loading`'s
    `WeightRenaming` and `WeightConverter`, told apart as
    `convert_and_load_state_dict_in_model` does)."""
    from transformers.core_model_loading import (  # noqa: PLC0415
        WeightConverter, WeightRenaming)

    return ([r for r in rules if isinstance(r, WeightRenaming)],
            [r for r in rules if isinstance(r, WeightConverter)])


def _rename(key: str, renamings: list, converters: list) -> tuple[str, str | None]:
    """The module name file tensor `key` loads into, and the source pattern of the
    converter that gathers it (None: a tensor loaded as it is, maybe renamed).

    Relies on `transformers.core_model_loading.rename_source_key` (every renaming, then
    at most one converter), without the base-model prefix it adds or strips against a
    built model."""
    from transformers.core_model_loading import rename_source_key  # noqa: PLC0415

    return rename_source_key(key, renamings, converters)


def _natural_order(keys: Iterable[str]) -> list[str]:
    """`keys` in the order `from_pretrained` reads them, which is the order a converter
    stacks its tensors in (expert 10 after expert 9): `core_model_loading.dot_natural_key`."""
    from transformers.core_model_loading import dot_natural_key  # noqa: PLC0415

    return sorted(keys, key=dot_natural_key)


@dataclass
class Group:
    """Module tensors one converter makes from several file tensors (a layer's experts)."""

    converter: Any
    """The `WeightConverter` (a copy is used for each conversion)."""
    first: str
    """The first module name it makes (transformers' layer name for the conversion)."""
    targets: tuple[str, ...]
    """Every module name it makes (several when it splits one tensor)."""
    sources: dict[str, list[str]] = field(default_factory=dict)
    """Its source patterns -> the file keys each gathered, in `from_pretrained`'s order."""
    problem: str | None = None
    """What is missing among its file tensors (an expert's), found when grouping."""


class ConvertedNames:
    """The module's names for a directory's tensors under `conversion_rules`: each either
    a file key (renamed or not) or a `Group` of file keys."""

    def __init__(self, keys: Iterable[str], rules: list):
        renamings, converters = _split_rules(rules)
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        self.plain: dict[str, str] = {}
        """Module name -> the file key that holds it."""
        self.groups: dict[str, Group] = {}
        """Module name -> the group that makes it (each of a group's targets)."""
        for key in _natural_order(keys):
            name, pattern = _rename(key, renamings, converters)
            if pattern is None:
                self.plain.setdefault(name, key)
                continue
            group = self.groups.get(name)
            if group is None:
                converter = by_pattern[pattern]
                first = converter.target_patterns[0]
                targets = tuple(name.replace(first, t) for t in converter.target_patterns)
                group = Group(converter, name, targets)
                for target in targets:
                    self.groups.setdefault(target, group)
            group.sources.setdefault(pattern, []).append(key)
        for group in {id(g): g for g in self.groups.values()}.values():
            group.problem = _missing_pieces(group)

    def names(self) -> list[str]:
        """Every module name, the plain ones first."""
        return list(self.plain) + [n for n in self.groups if n not in self.plain]

    def __contains__(self, name: str) -> bool:
        return name in self.plain or name in self.groups


def _missing_pieces(group: Group) -> str | None:
    """The file tensors a group of per-expert tensors lacks: each source pattern with a `*`
    (the expert's index) should have the same indices, 0 to the largest found."""
    found: dict[str, dict[int, str]] = {}
    for pattern in group.converter.source_patterns:
        if "*" not in pattern:
            return None  # not a list of experts: nothing to compare
        regex = re.compile(re.escape(pattern.replace(r"\.", ".")).replace(r"\*", r"(\d+)"))
        found[pattern] = {}
        for key in group.sources.get(pattern, ()):
            match = regex.search(key)
            if match is None:
                return None  # a pattern that is a regex of its own: not checked
            found[pattern][int(match.group(1))] = key
    count = 1 + max((i for keys in found.values() for i in keys), default=-1)
    for pattern, keys in found.items():
        if not keys:
            return (f"no tensor matches its source '{pattern}' (the others have "
                    f"{count} each)")
        gaps = [i for i in range(count) if i not in keys]
        if gaps:
            some = next(iter(keys.items()))
            missing = [_with_index(some[1], some[0], pattern, i) for i in gaps]
            return (f"no {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                    f"({len(keys)} of {count} found for '{pattern}')")
    return None


def _with_index(key: str, index: int, pattern: str, new: int) -> str:
    """File key `key` (of expert `index`, matching `pattern`) with expert `new` instead."""
    tail = pattern.split("*", 1)[1].replace(r"\.", ".")
    head = key[:len(key) - len(tail)] if key.endswith(tail) else None
    if head is None or not head.endswith(str(index)):
        return f"'{pattern.replace('*', str(new))}'"
    return head[:len(head) - len(str(index))] + str(new) + tail


def convert(group: Group, read: Callable[[str], torch.Tensor], config: Any = None
            ) -> dict[str, torch.Tensor]:
    """Every module tensor `group` makes, by module name, from the file tensors `read`
    gives (real ones, or meta ones for shapes alone), read only when the conversion asks.

    Relies on `transformers.core_model_loading.WeightConverter`: `add_tensor` with a
    callable (its synchronous loading) and `convert(layer_name, model=None, config=...)`,
    as `convert_and_load_state_dict_in_model` calls them, which runs the converter's
    operations (`MergeModulelist`, `Concatenate`, ...) and names the results in full."""
    converter = copy.deepcopy(group.converter)
    for pattern, keys in group.sources.items():
        for key in keys:
            converter.add_tensor(group.first, key, pattern, lambda key=key: read(key))
    values = converter.convert(group.first, model=None, config=config)
    return {name: value[0] if isinstance(value, list) else value
            for name, value in values.items()}
