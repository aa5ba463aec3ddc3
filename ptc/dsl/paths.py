"""File paths written in a plan file resolve against the plan file's folder.

`examples/run.ptc` saying `data = tokens("train.bin")` means
`examples/train.bin` wherever `ptc run` is started, as a Makefile or a
torchtitan TOML reader would take it. A path given as a command-line
override (`--runtime.checkpoint_dir ckpt`) has no place in the file and
stays relative to the working directory, as any shell argument does.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ptc.plan import Plan

PATH_FIELDS = (("train", "data", "path"), ("train", "init", "path"),
               ("runtime", None, "checkpoint_dir"), ("runtime", None, "metrics"),
               ("runtime", None, "tensorboard"))
"""(section, sub-section or None, field) of every plan field that names a file or folder."""


def resolve_paths(plan: Plan, folder: str | Path) -> Plan:
    """`plan` with each relative path written in its file joined to `folder`."""
    sections = {}
    for section, sub, name in PATH_FIELDS:
        outer = sections.get(section, getattr(plan, section))
        inner = getattr(outer, sub) if sub else outer
        value = getattr(inner, name, None)
        if not value or os.path.isabs(value) or inner.spans.get(name) is None:
            continue  # unset, absolute, or an override (no place in the file)
        inner = dataclasses.replace(inner, **{name: os.path.normpath(Path(folder, value))})
        sections[section] = dataclasses.replace(outer, **{sub: inner}) if sub else inner
    return dataclasses.replace(plan, **sections) if sections else plan
