"""Command-line overrides of plan fields: `--section.key value`, checked like plan lines.

`ptc run plan.ptc --parallel.tp 4 --train.steps 100` changes those keys of
the file's sections before the plan is built: each value is parsed by the
plan language itself (as if the line `key = value` stood in the section, a
missing section is added), then the whole plan is checked together. A
problem in an override is reported under its flag (`--parallel.tp: error:
...`, with the valid choices) instead of a file position.

A value that is not plan syntax (`ckpt/run-1`), or a bare word given to a key
that takes a string, is read as that string, so paths need no quotes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ptc.dsl import ast
from ptc.dsl.schema import SECTIONS
from ptc.dsl.source import NOWHERE, Source
from ptc.dsl.syntax import parse_syntax
from ptc.dsl.values import string
from ptc.errors import Diagnostic, PlanError


def split_overrides(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """(the other arguments, {"section.key": value text}) of a command line; an override
    is `--section.key value` or `--section.key=value`."""
    rest, overrides, i = [], {}, 0
    while i < len(argv):
        arg = argv[i]
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if "." not in name:
            rest.append(arg)
            i += 1
            continue
        if "=" in arg:
            overrides[name] = arg.split("=", 1)[1]
            i += 1
        elif i + 1 < len(argv):
            overrides[name] = argv[i + 1]
            i += 2
        else:
            raise PlanError([Diagnostic(message="needs a value, e.g. --parallel.tp 4",
                                        field=f"--{name}")])
    return rest, overrides


def apply_overrides(tree: ast.PlanFile, overrides: Mapping[str, object]) -> ast.PlanFile:
    """The file's sections with each override's `key = value` set in its section."""
    sections = list(tree.sections)
    problems = []
    for name, value in overrides.items():
        section, _, key = str(name).partition(".")
        if section not in SECTIONS or not key or "." in key:
            problems.append(Diagnostic(
                message=f"no plan field {name!r}; write --section.key with a section of "
                        f"{', '.join(SECTIONS)}", field=f"--{name}", choices=tuple(SECTIONS)))
            continue
        assign = _parse_value(section, key, value, problems)
        if assign is None:
            continue
        index = next((i for i, s in enumerate(sections) if s.keyword == section), None)
        if index is None:
            sections.append(ast.Section(keyword=section, keyword_pos=tree.end, argument=None,
                                        items=(assign,), pos=tree.end))
            continue
        old = sections[index]
        items = [item for item in old.items if not (isinstance(item, ast.Assign)
                                                     and item.key == key)]
        sections[index] = dataclasses.replace(old, items=(*items, assign))
    if problems:
        raise PlanError(problems)
    return dataclasses.replace(tree, sections=tuple(sections))


def relabel(error: PlanError, overrides: Mapping[str, object]) -> PlanError:
    """Report the diagnostics of overridden fields under their flags, not a file position."""
    def moved(d: Diagnostic) -> Diagnostic:
        for name in overrides:
            if d.field == name or d.field.startswith(f"{name}."):
                return dataclasses.replace(d, field=f"--{d.field}", span=None)
        return d

    return PlanError([moved(d) for d in error.diagnostics])


def _parse_value(section: str, key: str, value: object, problems: list) -> ast.Assign | None:
    """`key = value` parsed as the plan language reads it inside `section`."""
    text = value if isinstance(value, str) else _literal(value)
    source = Source(file=f"--{section}.{key}", text=f"{section} {{\n{key} = {text}\n}}\n")
    tree = parse_syntax(source)
    assign = None if tree is None or source.sink.errors else next(
        (i for i in tree.sections[0].items if isinstance(i, ast.Assign)), None)
    assign = _nowhere(assign) if assign is not None else None
    takes_string = _takes_string(section, key)
    if assign is None or (takes_string and isinstance(assign.value, ast.Name)
                          and assign.value.name != "none"):
        if not isinstance(value, str):
            problems.append(Diagnostic(message=f"cannot read {value!r} as a plan value",
                                       field=f"--{section}.{key}"))
            return None
        # Not plan syntax, or a bare word for a string key: the text itself.
        return ast.Assign(key=key, key_pos=NOWHERE, value=ast.Str(value=value, pos=NOWHERE))
    return assign


def _nowhere(node):
    """`node` with every position NOWHERE: it is not in the file, so no caret points into it
    (a problem it causes is shown at its section, or under its flag)."""
    if isinstance(node, ast.Pos):
        return NOWHERE
    if isinstance(node, tuple):
        return tuple(_nowhere(item) for item in node)
    if dataclasses.is_dataclass(node):
        return dataclasses.replace(node, **{f.name: _nowhere(getattr(node, f.name))
                                            for f in dataclasses.fields(node)})
    return node


def _literal(value: object) -> str:
    """Python value -> plan text: numbers and booleans as written, strings quoted."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def _takes_string(section: str, key: str) -> bool:
    entry = SECTIONS[section].get(key)
    convert = getattr(entry, "convert", None)
    return convert is string or getattr(convert, "inner", None) is string

