"""Converters from AST values to the Python values plan fields hold.

A *converter* is `conv(reader, node, key) -> value`. It either returns the
converted value or records one diagnostic and returns `INVALID`, so a
section can go on reading its other keys and report every problem of the
file at once. Converters check kinds and units (an integer, a quantity of
bytes, one of a few words); ranges and cross-field rules stay with the plan
dataclasses, which know them already.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from ptc.dsl import ast
from ptc.dsl.source import Source
from ptc.errors import did_you_mean
from ptc.units import DIMENSION_EXAMPLES, UNITS, units_of


class _Invalid:
    """The type of `INVALID`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "INVALID"


INVALID: Any = _Invalid()
"""Returned by a converter that has already reported why the value is wrong."""

Converter = Callable[["Reader", ast.Value, str], Any]

_DIMENSION_WORDS = {"bytes": "bytes", "bandwidth": "a bandwidth", "flops": "FLOP/s",
                    "time": "a time", "power": "a power"}


class Reader:
    """Converts values of one plan section (or call), reporting into its `Source`.

    `path` is the dotted field path of what is being read ("parallel",
    "train.optimizer"); diagnostics carry `path.key` as their field.
    """

    def __init__(self, source: Source, path: str):
        self.source = source
        self.path = path

    def at(self, path: str) -> Reader:
        """A reader of a nested part (a call's arguments), same source."""
        return Reader(self.source, path)

    def error(self, message: str, pos: ast.Pos | None, key: str = "",
              choices: tuple[str, ...] | list[str] = ()) -> Any:
        """Record an error about `key` at `pos`; returns INVALID for convenience."""
        field = f"{self.path}.{key}" if key else self.path
        self.source.error(message, pos, field=field, choices=choices)
        return INVALID


def show(node: ast.Value) -> str:
    """The value as the user wrote it (abridged), for messages."""
    match node:
        case ast.Int(value=v):
            return str(v)
        case ast.Float(value=v):
            return repr(v)
        case ast.Quantity(number=n, unit=u):
            return f"{show(n)} {u}"
        case ast.Str(value=v):
            text = v if len(v) <= 40 else v[:40] + "..."
            return '"' + text.replace('"', '\\"') + '"'
        case ast.Name(name=n):
            return n
        case ast.Range(start=a, stop=b):
            return f"{a}..{b}"
        case ast.Call(name=n):
            return f"{n}(...)"
        case ast.Tuple():
            return "(...)"
        case ast.List():
            return "[...]"
    return "an invalid value"


def _got(node: ast.Value) -> str:
    if isinstance(node, (ast.Call, ast.Tuple, ast.List)):
        return ast.value_kind(node)
    return f"{show(node)} ({ast.value_kind(node)})"


def _plain_with_unit(r: Reader, node: ast.Quantity, key: str, what: str) -> Any:
    dim = UNITS.get(node.unit, ("an unknown unit",))[0]
    dim_text = _DIMENSION_WORDS.get(dim, dim)
    return r.error(f"{key} is {what} without a unit, got {show(node)} ({dim_text})",
                   node.pos, key)


# ------------------------------------------------------------ scalar kinds


def integer(r: Reader, node: ast.Value, key: str) -> Any:
    """An integer literal."""
    if isinstance(node, ast.Int):
        return node.value
    if isinstance(node, ast.Invalid):
        return INVALID
    if isinstance(node, ast.Quantity):
        return _plain_with_unit(r, node, key, "a plain integer")
    return r.error(f"{key} must be an integer, got {_got(node)}", node.pos, key)


def int_or_auto(r: Reader, node: ast.Value, key: str) -> Any:
    """An integer, or the word `auto` (the planner picks)."""
    if isinstance(node, ast.Name) and node.name == "auto":
        return "auto"
    if isinstance(node, ast.Int) or isinstance(node, ast.Invalid):
        return integer(r, node, key)
    if isinstance(node, ast.Quantity):
        return _plain_with_unit(r, node, key, "an integer or auto")
    return r.error(f"{key} must be an integer or auto, got {_got(node)}", node.pos, key)


def number(r: Reader, node: ast.Value, key: str) -> Any:
    """An integer or float literal, as a float."""
    if isinstance(node, (ast.Int, ast.Float)):
        return float(node.value)
    if isinstance(node, ast.Invalid):
        return INVALID
    if isinstance(node, ast.Quantity):
        return _plain_with_unit(r, node, key, "a plain number")
    return r.error(f"{key} must be a number, got {_got(node)}", node.pos, key)


def boolean(r: Reader, node: ast.Value, key: str) -> Any:
    """`true` or `false`."""
    if isinstance(node, ast.Name) and node.name in ("true", "false"):
        return node.name == "true"
    if isinstance(node, ast.Invalid):
        return INVALID
    return r.error(f"{key} must be true or false, got {_got(node)}", node.pos, key,
                   ("true", "false"))


def string(r: Reader, node: ast.Value, key: str) -> Any:
    """A string literal ("...")."""
    if isinstance(node, ast.Str):
        return node.value
    if isinstance(node, ast.Invalid):
        return INVALID
    return r.error(f"{key} must be a string in double quotes, got {_got(node)}", node.pos, key)


def word(choices: tuple[str, ...]) -> Converter:
    """One of `choices`, written as a bare name (or a string)."""

    def convert(r: Reader, node: ast.Value, key: str) -> Any:
        if isinstance(node, ast.Invalid):
            return INVALID
        if not isinstance(node, (ast.Name, ast.Str)):
            return r.error(f"{key} must be one of {', '.join(choices)}, got {_got(node)}",
                           node.pos, key, choices)
        value = node.name if isinstance(node, ast.Name) else node.value
        if value not in choices:
            return r.error(f"{key} = {show(node)} is not a valid choice"
                           f"{did_you_mean(value, choices)}", node.pos, key, choices)
        return value

    return convert


def optional(conv: Converter) -> Converter:
    """`conv`, or the word `none` for None."""

    def convert(r: Reader, node: ast.Value, key: str) -> Any:
        if isinstance(node, ast.Name) and node.name == "none":
            return None
        return conv(r, node, key)

    convert.inner = conv  # what it reads besides none (overrides ask: a string?)
    return convert


def quantity(dimension: str) -> Converter:
    """A number with a unit of `dimension` ("bytes", "bandwidth", "flops", "time", "power"),
    converted to the base unit (bytes, bytes/s, FLOP/s, seconds, watts)."""
    example = DIMENSION_EXAMPLES[dimension]
    dim_text = _DIMENSION_WORDS[dimension]

    def convert(r: Reader, node: ast.Value, key: str) -> Any:
        if isinstance(node, ast.Invalid):
            return INVALID
        if isinstance(node, (ast.Int, ast.Float)):
            return r.error(f"{key} needs a unit of {dim_text}, e.g. {key} = "
                           f"{example.split(',')[0]}", node.pos, key, units_of(dimension))
        glued = _glued(node)
        if glued:
            return r.error(f"{key} = {show(node)}: write a space between the number and "
                           f"the unit, {glued}", node.pos, key)
        if not isinstance(node, ast.Quantity):
            return r.error(f"{key} must be {dim_text} with a unit (e.g. {example}), "
                           f"got {_got(node)}", node.pos, key)
        if node.unit not in UNITS:
            return unknown_unit(r, node, key, dimension)
        dim, scale = UNITS[node.unit]
        if dim != dimension:
            return r.error(f"{key} expects {dim_text} (e.g. {example}), got {show(node)}, "
                           f"which is {_DIMENSION_WORDS[dim]}", node.pos, key,
                           units_of(dimension))
        value = node.number.value * scale
        if not math.isfinite(value):
            return r.error(f"{key} = {show(node)} is too large to represent", node.pos, key)
        return float(value)

    return convert


def quantity_or_auto(dimension: str) -> Converter:
    """`quantity(dimension)`, or the word `auto` (the compiler derives the value)."""
    conv = quantity(dimension)

    def convert(r: Reader, node: ast.Value, key: str) -> Any:
        if isinstance(node, ast.Name) and node.name == "auto":
            return "auto"
        return conv(r, node, key)

    return convert


def _glued(node: ast.Value) -> str:
    """`80 GiB` for the name `80GiB`, else ""."""
    if not isinstance(node, ast.Name):
        return ""
    match = re.fullmatch(r"(\d+)([A-Za-z].*)", node.name)
    return f"{match[1]} {match[2]}" if match and match[2] in UNITS else ""


def unknown_unit(r: Reader, node: ast.Quantity, key: str, dimension: str | None) -> Any:
    """Report a unit that is not in the unit table."""
    valid = units_of(dimension) if dimension else sorted(UNITS)
    # Units are short, so one wrong letter in two is still worth suggesting.
    return r.error(f"unknown unit '{node.unit}'{did_you_mean(node.unit, valid, cutoff=0.5)}",
                   node.unit_pos, key, valid)


def number_pair(r: Reader, node: ast.Value, key: str) -> Any:
    """A tuple of two numbers, e.g. betas = (0.9, 0.95)."""
    if isinstance(node, ast.Invalid):
        return INVALID
    if not isinstance(node, ast.Tuple) or len(node.items) != 2:
        return r.error(f"{key} must be a pair of numbers, e.g. {key} = (0.9, 0.95), "
                       f"got {_got(node)}", node.pos, key)
    items = [number(r, item, key) for item in node.items]
    return INVALID if INVALID in items else tuple(items)


def word_tuple(r: Reader, node: ast.Value, key: str) -> Any:
    """A tuple (or list) of bare names, e.g. order = (tp, dp, pp)."""
    if isinstance(node, ast.Invalid):
        return INVALID
    if not isinstance(node, (ast.Tuple, ast.List)) or \
            not all(isinstance(i, ast.Name) for i in node.items):
        return r.error(f"{key} must be a tuple of names, e.g. {key} = (tp, dp, pp), "
                       f"got {_got(node)}", node.pos, key)
    return tuple(i.name for i in node.items)


def string_list(r: Reader, node: ast.Value, key: str) -> Any:
    """A list (or tuple) of strings or `none`, e.g. ["layers.20", none, "layers.60"]."""
    if isinstance(node, ast.Invalid):
        return INVALID
    if not isinstance(node, (ast.Tuple, ast.List)) or not all(
            isinstance(i, ast.Str) or (isinstance(i, ast.Name) and i.name == "none")
            for i in node.items):
        return r.error(f"{key} must be a list of strings or none, e.g. "
                       f"{key} = [\"layers.20\", none], got {_got(node)}", node.pos, key)
    return tuple(i.value if isinstance(i, ast.Str) else None for i in node.items)


def python_value(r: Reader, node: ast.Value, key: str) -> Any:
    """Any plain value as Python data: numbers, strings, true/false/none, names
    (as strings), quantities (in base units), tuples and lists of these."""
    match node:
        case ast.Int(value=v) | ast.Float(value=v):
            return v
        case ast.Str(value=v):
            return v
        case ast.Name(name="true"):
            return True
        case ast.Name(name="false"):
            return False
        case ast.Name(name="none"):
            return None
        case ast.Name(name=n):
            return n
        case ast.Quantity(unit=u):
            if u not in UNITS:
                return unknown_unit(r, node, key, None)
            return quantity(UNITS[u][0])(r, node, key)
        case ast.Tuple(items=items) | ast.List(items=items):
            values = [python_value(r, item, key) for item in items]
            if any(v is INVALID for v in values):
                return INVALID
            return tuple(values) if isinstance(node, ast.Tuple) else values
        case ast.Invalid():
            return INVALID
    return r.error(f"{key}: {ast.value_kind(node)} cannot be passed to a model factory; "
                   f"use numbers, strings, names, tuples or lists", node.pos, key)
