"""File paths written in a plan file resolve against the plan file's folder.

`examples/run.ptc` saying `data = tokens("train.bin")` means
`examples/train.bin` wherever `ptc run` is started, as a Makefile or a
torchtitan TOML reader would take it. A path given as a command-line
override (`--runtime.checkpoint_dir ckpt`) has no place in the file and
stays relative to the working directory, as any shell argument does.

`absolute_paths` makes every path a plan names absolute, the hardware
profile's too, so that its text (`dump_plan`) means the same files from any
folder: `ptc run` writes the resolved plan into the run's log folder, where
each worker reads it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ptc.plan import Plan

PATH_FIELDS = (("train", "data", "path"), ("train", "init", "path"),
               ("runtime", None, "checkpoint_dir"), ("runtime", None, "metrics"),
               ("runtime", None, "tensorboard"))
"""(section, sub-section or None, field) of every plan field that names a file or folder."""


def resolve_paths(plan: Plan, folder: str | Path) -> Plan:
    """`plan` with each relative path written in its file joined to `folder`."""
    def joined(inner, name: str, value: str) -> str:
        if os.path.isabs(value) or inner.spans.get(name) is None:
            return value  # absolute, or an override (no place in the file)
        return os.path.normpath(Path(folder, value))

    return _replace_paths(plan, PATH_FIELDS, joined)


def absolute_paths(plan: Plan) -> Plan:
    """`plan` with every path it names, the hardware profile included, made absolute from
    the working directory (where `resolve_paths` left them relative to it)."""
    return _replace_paths(plan, (*PATH_FIELDS, ("hardware", None, "profile")),
                          lambda inner, name, value: os.path.abspath(value))


def _replace_paths(plan: Plan, fields: Iterable[tuple[str, str | None, str]],
                   new_path: Callable[[Any, str, str], str]) -> Plan:
    """`plan` with the value of each set path of `fields` replaced by
    `new_path(the (sub-)section that holds it, its name, its value)`."""
    sections = {}
    for section, sub, name in fields:
        outer = sections.get(section, getattr(plan, section))
        inner = getattr(outer, sub) if sub else outer
        value = getattr(inner, name, None)
        changed = new_path(inner, name, value) if value else value
        if changed == value:
            continue
        inner = dataclasses.replace(inner, **{name: changed})
        sections[section] = dataclasses.replace(outer, **{sub: inner}) if sub else inner
    return dataclasses.replace(plan, **sections) if sections else plan
