"""Step three of the DSL: AST -> `Plan`, reporting every problem of the file.

Sections are read key by key against the tables in `ptc.dsl.schema`:
unknown keys (with a suggestion), duplicates, missing required keys (at the
section header), wrong kinds and units. Each section is then built as its
plan dataclass, which checks ranges and choices. Only when all sections are
clean is the `Plan` built, running the cross-section checks (tp*pp*dp vs
GPUs, heads vs tp, ...): those rules would only repeat noise on top of a
section that is already wrong.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ptc.dsl import ast, calls
from ptc.dsl.construct import construct
from ptc.dsl.schema import (
    CUSTOM_GPU_KEYS,
    DIRECTIVES,
    HARDWARE_KEYS,
    MODEL_FAMILIES,
    MODEL_KEYS,
    PARALLEL_KEYS,
    REQUIRED_SECTIONS,
    MOE_KEYS,
    RUNTIME_KEYS,
    SECTIONS,
    TRAIN_KEYS,
    Key,
)
from ptc.dsl.source import Source
from ptc.dsl.values import INVALID, Reader, python_value, word
from ptc.errors import Diagnostic, PlanError, Span, did_you_mean
from ptc.hwprofile import ProfileError, load_profile
from ptc.plan import (
    SHARD_STYLES,
    HardwareSpec,
    profile_fields,
    ModelSpec,
    ParallelSpec,
    Plan,
    MoESpec,
    RuntimeSpec,
    ShardRule,
    TrainSpec,
)
from ptc.presets import PRESETS


@dataclass(slots=True)
class SectionRead:
    """The keys of one section as read: good values and where each was written."""

    values: dict[str, Any] = field(default_factory=dict)
    """Field name -> converted value (wrong values left out)."""
    spans: dict[str, Span] = field(default_factory=dict)
    """Field name -> span of the value."""
    given: set[str] = field(default_factory=set)
    """Keys written in the section, right or wrong."""
    bad: set[str] = field(default_factory=set)
    """Fields whose value was reported as wrong."""
    suggested: set[str] = field(default_factory=set)
    """Keys offered as "did you mean" for an unknown key: not reported missing too."""


def build_plan(tree: ast.PlanFile, source: Source) -> Plan:
    """Turn a parsed file into a `Plan`; raise `PlanError` with every problem found."""
    sections = _index_sections(tree, source)
    model, layers = _model(sections.get("model"), source)
    hardware = _hardware(sections.get("hardware"), source)
    parallel = _parallel(sections.get("parallel"), source, layers)
    train = _train(sections.get("train"), source)
    runtime = _runtime(sections.get("runtime"), source)
    moe = _moe(sections.get("moe"), source)
    source.sink.raise_if_errors()
    parts = {"model": model, "hardware": hardware, "train": train}
    if parallel is not None:
        parts["parallel"] = parallel
    if runtime is not None:
        parts["runtime"] = runtime
    if moe is not None:
        parts["moe"] = moe
    headers = {name: sec.pos for name, sec in sections.items()}
    try:
        plan = Plan(**parts, source=source.file)
    except PlanError as exc:
        raise PlanError(sorted((_place(d, headers, source) for d in exc.diagnostics),
                               key=_order)) from None
    object.__setattr__(plan, "warnings",
                       tuple(_place(w, headers, source) for w in plan.warnings))
    return plan


def _order(d: Diagnostic) -> tuple:
    return (0, d.span.line, d.span.column) if d.span else (1, 0, 0)


def _place(d: Diagnostic, headers: dict[str, ast.Pos], source: Source) -> Diagnostic:
    """Give a diagnostic without a span the header of its section (or hardware's)."""
    if d.span is not None:
        return d
    section = d.field.split(".", 1)[0]
    pos = headers.get(section) or headers.get("hardware") or next(iter(headers.values()), None)
    return dataclasses.replace(d, span=source.span(pos)) if pos else d


# ----------------------------------------------------------------- sections


def _index_sections(tree: ast.PlanFile, source: Source) -> dict[str, ast.Section]:
    found: dict[str, ast.Section] = {}
    for sec in tree.sections:
        if sec.keyword not in SECTIONS:
            source.error(f"unknown section '{sec.keyword}'{did_you_mean(sec.keyword, SECTIONS)}",
                         sec.keyword_pos, choices=tuple(SECTIONS))
        elif sec.keyword in found:
            source.error(f"duplicate section '{sec.keyword}' (first at line "
                         f"{found[sec.keyword].pos.line})", sec.keyword_pos,
                         field=sec.keyword)
        else:
            found[sec.keyword] = sec
            if sec.keyword != "model" and sec.argument is not None:
                source.error(f"{sec.keyword} takes no name; write {sec.keyword} {{ ... }}",
                             sec.argument.pos, field=sec.keyword)
    for name in REQUIRED_SECTIONS:
        if name not in found:
            keys = [k for k, key in SECTIONS[name].items() if key.required]
            source.error(f"missing required section '{name}' (it needs at least "
                         f"{', '.join(keys)})", tree.end, field=name)
    return found


def _read_items(sec: ast.Section, keys: dict[str, Key], r: Reader,
                overrides: dict[str, Any] | None = None) -> SectionRead:
    """Read every `key = value` of `sec` with the converters of `keys`."""
    read = SectionRead()
    first: dict[str, ast.Pos] = {}
    overrides = overrides or {}
    for item in sec.items:
        if isinstance(item, ast.Directive):
            if item.keyword not in DIRECTIVES.get(sec.keyword, ()):
                _unknown_statement(item, sec.keyword, r)
            continue
        if item.key not in keys:
            read.suggested.update(_unknown_key(item, sec.keyword, keys, r))
            continue
        if item.key in first:
            r.error(f"duplicate key '{item.key}' (first set at line {first[item.key].line})",
                    item.key_pos, item.key)
            continue
        first[item.key] = item.key_pos
        read.given.add(item.key)
        key = keys[item.key]
        value = overrides.get(item.key, key.convert)(r, item.value, item.key)
        if value is INVALID:
            read.bad.add(key.field)
            continue
        read.values[key.field] = value
        read.spans[key.field] = r.source.span(item.value.pos)
    return read


def _unknown_key(item: ast.Assign, section: str, keys: dict[str, Key], r: Reader) -> list[str]:
    """Report an unknown key; return the key suggested instead, if any."""
    hint = did_you_mean(item.key, keys)
    suggested = [k for k in keys if hint == f"; did you mean '{k}'?"]
    if not hint:
        home = [name for name, table in SECTIONS.items() if item.key in table and name != section]
        if home:
            hint = f"; {item.key} belongs in the {home[0]} section"
    r.error(f"unknown key '{item.key}' in {section}{hint}", item.key_pos, item.key, tuple(keys))
    return suggested


def _unknown_statement(item: ast.Directive, section: str, r: Reader) -> None:
    accepted = DIRECTIVES.get(section, ())
    if accepted:
        hint = did_you_mean(item.keyword, accepted)
    else:
        homes = [s for s, words in DIRECTIVES.items() if item.keyword in words]
        hint = (f"; {item.keyword} lines belong in the {homes[0]} section" if homes
                else "; write key = value")
    r.error(f"unknown statement '{item.keyword} \"...\" {item.word.name}' in {section}{hint}",
            item.keyword_pos, item.keyword, accepted)


def _missing(sec: ast.Section, read: SectionRead, keys: dict[str, Key], r: Reader,
             required: tuple[str, ...] | None = None, why: str = "") -> dict[str, Any]:
    """Report required keys not written; return placeholders for them and for bad ones."""
    names = required if required is not None else tuple(k for k, v in keys.items() if v.required)
    for name in names:
        # A misspelt key was already reported with this one as the fix.
        if name not in read.given and name not in read.suggested:
            example = f" (e.g. {keys[name].example})" if keys[name].example else ""
            r.error(f"{sec.keyword} is missing required key '{name}'{why}{example}", sec.pos,
                    name)
    return {keys[n].field: keys[n].placeholder for n in names
            if keys[n].field not in read.values}


# -------------------------------------------------------------------- model


def _model(sec: ast.Section | None, source: Source) -> tuple[Any, int | None]:
    """The ModelSpec (or INVALID) and the layer count if known."""
    if sec is None:
        return INVALID, None
    r = Reader(source, "model")
    arg = sec.argument
    if isinstance(arg, ast.Str):
        return _custom_model(sec, arg, r), None
    family = None
    if arg is None:
        r.error('model needs a family: model gpt { ... }, model llama { ... } or '
                'model "package.module:factory" { ... }', sec.pos, "family",
                (*MODEL_FAMILIES, '"package.module:factory"'))
    elif arg.name not in MODEL_FAMILIES:
        r.error(f"unknown model family '{arg.name}'{did_you_mean(arg.name, MODEL_FAMILIES)}",
                arg.pos, "family", (*MODEL_FAMILIES, '"package.module:factory"'))
    else:
        family = arg.name
    read = _read_items(sec, MODEL_KEYS, r)
    layers = read.values.get("layers")
    if family is None:
        return INVALID, layers
    required = tuple(k for k, v in MODEL_KEYS.items() if v.required)
    if family == "llama":
        required += ("ffn",)
    fill = _missing(sec, read, MODEL_KEYS, r, required,
                    " (llama's SwiGLU inner size)" if family == "llama" and
                    "ffn" not in read.given else "")
    values = {**read.values, **fill, "family": family,
              "spans": {**read.spans, "family": source.span(arg.pos)}}
    model = construct(ModelSpec, values, source, placeholders=set(fill) | read.bad)
    return model, layers


def _custom_model(sec: ast.Section, arg: ast.Str, r: Reader) -> Any:
    kwargs: dict[str, Any] = {}
    spans = {"factory": r.source.span(arg.pos)}
    first: dict[str, ast.Pos] = {}
    ok = True
    for item in sec.items:
        if isinstance(item, ast.Directive):
            _unknown_statement(item, "model", r)
            ok = False
        elif item.key in first:
            r.error(f"duplicate key '{item.key}' (first set at line {first[item.key].line})",
                    item.key_pos, item.key)
            ok = False
        else:
            first[item.key] = item.key_pos
            value = python_value(r, item.value, item.key)
            if value is INVALID:
                ok = False
            else:
                kwargs[item.key] = value
    model = construct(ModelSpec, {"family": "custom", "factory": arg.value, "kwargs": kwargs,
                                  "spans": spans}, r.source)
    return model if ok else INVALID


# ----------------------------------------------------------------- hardware


def _hardware(sec: ast.Section | None, source: Source) -> Any:
    if sec is None:
        return INVALID
    r = Reader(source, "hardware")
    read = _read_items(sec, HARDWARE_KEYS, r)
    fill = _missing(sec, read, HARDWARE_KEYS, r)
    gpu = read.values.get("gpu")
    if gpu is None:  # missing or not a known gpu: already reported
        return INVALID
    spans = read.spans
    profiled = _profile(read, source, gpu)
    if gpu == "custom":
        given = SectionRead(values=read.values, given=read.given | {
            key for key, k in HARDWARE_KEYS.items() if k.field in profiled},
            suggested=read.suggested)
        fill = _missing(sec, given, HARDWARE_KEYS, r, CUSTOM_GPU_KEYS, " when gpu = custom")
        values = {**profiled, **read.values, **fill, "spans": spans}
        return construct(HardwareSpec, values, source, placeholders=set(fill) | read.bad)
    assert gpu in PRESETS
    return construct(HardwareSpec.preset, {**profiled, **read.values, **fill, "spans": spans},
                     source, placeholders=read.bad)


def _profile(read: SectionRead, source: Source, gpu: str) -> dict[str, Any]:
    """The figures of the calibration file `profile = "..."` names (`ptc.hwprofile`), and
    the path it was read from as `profile`; {} without one. A path written in the file is
    read from the file's folder, one given on the command line from the working directory.
    A missing or malformed file, or one measured on another kind of device, is one error at
    the key's value."""
    written = read.values.get("profile")
    if not written:
        return {}
    span = read.spans.get("profile")
    path = written if span is None or os.path.isabs(written) or source.file.startswith("<") \
        else os.path.normpath(Path(source.file).parent / written)
    read.values["profile"] = path
    try:
        figures = profile_fields(path)
        device = load_profile(path).device
    except ProfileError as exc:
        source.sink.error(f"hardware profile {written}: {exc}", field="hardware.profile",
                          span=span)
        read.bad.add("profile")
        del read.values["profile"]
        return {}
    if (device == "cpu") != (gpu == "cpu"):
        kind = "a CPU" if device == "cpu" else "a GPU"
        source.sink.error(f"hardware profile {written} was measured on {kind}, but gpu is "
                          f"{gpu}; calibrate on the plan's device", field="hardware.profile",
                          span=span)
        read.bad.add("profile")
        del read.values["profile"]
        return {}
    _same_power_limit(read, source, figures, written)
    return {**figures, "profile": path}


def _same_power_limit(read: SectionRead, source: Source, figures: dict[str, Any],
                      written: str) -> None:
    """A profile's rates are those of the power limit it was measured under: a plan that
    writes another limit beside it is one error at its `power_limit`."""
    measured, given = figures.get("power_limit"), read.values.get("power_limit")
    if measured is None or given is None or given == measured:
        return
    source.sink.error(f"power_limit = {given:g} W, but hardware profile {written} was measured "
                      f"under {measured:g} W, the limit its rates hold at; calibrate under "
                      f"{given:g} W", field="hardware.power_limit",
                      span=read.spans.get("power_limit"))
    read.bad.add("power_limit")


# ----------------------------------------------------------------- parallel


def _parallel(sec: ast.Section | None, source: Source, layers: int | None) -> Any:
    if sec is None:
        return None
    r = Reader(source, "parallel")
    read = _read_items(sec, PARALLEL_KEYS, r, {"checkpoint": calls.checkpoint(layers)})
    values, spans = read.values, read.spans
    if "schedule" in values:
        name, vstages, vspan = values["schedule"]
        values["schedule"] = name
        if vstages is not None:
            if "virtual_stages" in values and values["virtual_stages"] != vstages:
                r.error(f"virtual_stages is {values['virtual_stages']} but the schedule says "
                        f"{name}(virtual_stages = {vstages}); give it once",
                        _pos_of(spans["virtual_stages"]), "virtual_stages")
                read.bad.add("virtual_stages")
            values["virtual_stages"] = vstages
            spans["virtual_stages"] = vspan
    shards = _shards(sec, r)
    if shards is INVALID:
        read.bad.add("shards")
    else:
        values["shards"] = shards
    return construct(ParallelSpec, {**values, "spans": spans}, source, placeholders=read.bad)


def _pos_of(span: Span) -> ast.Pos:
    return ast.Pos(span.line, span.column, span.line, span.end_column or span.column + 1)


def _shards(sec: ast.Section, r: Reader) -> Any:
    rules: list[ShardRule] = []
    ok = True
    style = word(SHARD_STYLES)
    for item in sec.items:
        if not (isinstance(item, ast.Directive) and item.keyword == "shard"):
            continue
        sub = r.at("parallel.shard")
        value = style(sub, item.word, "style")
        if value is INVALID:
            ok = False
            continue
        spans = {"pattern": r.source.span(item.pattern.pos), "style": r.source.span(item.word.pos)}
        rule = construct(ShardRule, {"pattern": item.pattern.value, "style": value,
                                     "spans": spans}, r.source)
        if rule is INVALID:
            ok = False
        else:
            rules.append(rule)
    return tuple(rules) if ok else INVALID


# ------------------------------------------------------------ train, runtime


def _train(sec: ast.Section | None, source: Source) -> Any:
    if sec is None:
        return INVALID
    r = Reader(source, "train")
    read = _read_items(sec, TRAIN_KEYS, r)
    fill = _missing(sec, read, TRAIN_KEYS, r)
    values = {**read.values, **fill, "spans": read.spans}
    return construct(TrainSpec, values, source, placeholders=set(fill) | read.bad)


def _moe(sec: ast.Section | None, source: Source) -> Any:
    if sec is None:
        return None
    r = Reader(source, "moe")
    read = _read_items(sec, MOE_KEYS, r)
    return construct(MoESpec, {**read.values, "spans": read.spans}, source, placeholders=read.bad)


def _runtime(sec: ast.Section | None, source: Source) -> Any:
    if sec is None:
        return None
    r = Reader(source, "runtime")
    read = _read_items(sec, RUNTIME_KEYS, r)
    return construct(RuntimeSpec, {**read.values, "spans": read.spans}, source,
                     placeholders=read.bad)

