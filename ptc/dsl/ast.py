"""The syntax tree of a plan file: plain frozen dataclasses with positions.

This is step two of the DSL (grammar -> AST -> semantic check). Nodes say
only what was written, never what it means: `Name("bf16")` is a bare word,
whether it is a dtype is for `ptc.dsl.semantic` to decide. Every node keeps
its `Pos` so that any diagnostic can point at line and column.

Terms: a *section* is `model gpt { ... }`; an *item* is one `key = value` or
one directive (`shard "glob" colwise`) inside it; a *value* is anything to
the right of `=`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Pos:
    """Where a node is: 1-based line and column of its first character and
    the line and column just past its last character."""

    line: int
    column: int
    end_line: int
    end_column: int


# ------------------------------------------------------------------- values


@dataclass(frozen=True, slots=True)
class Int:
    """An integer literal, e.g. `4096` or `1_000`."""

    value: int
    pos: Pos


@dataclass(frozen=True, slots=True)
class Float:
    """A floating-point literal, e.g. `1.5e-4` (always finite)."""

    value: float
    pos: Pos


@dataclass(frozen=True, slots=True)
class Quantity:
    """A number with a unit, e.g. `80 GiB`; the unit is not checked yet."""

    number: Int | Float
    unit: str
    unit_pos: Pos
    pos: Pos


@dataclass(frozen=True, slots=True)
class Str:
    """A string literal, escapes already decoded."""

    value: str
    pos: Pos


@dataclass(frozen=True, slots=True)
class Name:
    """A bare word: `gelu`, `auto`, `true`, `none`, `1f1b`."""

    name: str
    pos: Pos


@dataclass(frozen=True, slots=True)
class Range:
    """An inclusive integer range `start..stop`, e.g. `0..39`."""

    start: int
    stop: int
    pos: Pos


@dataclass(frozen=True, slots=True)
class KwArg:
    """One `key = value` argument of a call."""

    key: str
    key_pos: Pos
    value: Value
    key_call: Call | None = None
    """The key when it is written as a call (`modules(mlp) = 0..3`; `key` is its name)."""


@dataclass(frozen=True, slots=True)
class Call:
    """`name(positional..., key = value, ...)`, e.g. `link(bandwidth = 450 GB/s)`."""

    name: str
    name_pos: Pos
    args: tuple[Value, ...]
    kwargs: tuple[KwArg, ...]
    pos: Pos


@dataclass(frozen=True, slots=True)
class Tuple:
    """`(a, b, ...)`."""

    items: tuple[Value, ...]
    pos: Pos


@dataclass(frozen=True, slots=True)
class List:
    """`[a, b, ...]`."""

    items: tuple[Value, ...]
    pos: Pos


@dataclass(frozen=True, slots=True)
class Invalid:
    """A literal that was already reported as wrong (e.g. a number too large).

    Later steps skip it silently, so one mistake yields one diagnostic.
    """

    pos: Pos


Value = Int | Float | Quantity | Str | Name | Range | Call | Tuple | List | Invalid


# -------------------------------------------------------------- statements


@dataclass(frozen=True, slots=True)
class Assign:
    """`key = value` inside a section."""

    key: str
    key_pos: Pos
    value: Value


@dataclass(frozen=True, slots=True)
class Directive:
    """`keyword "string" word`, e.g. `shard "layers.*.mlp.up" colwise`."""

    keyword: str
    keyword_pos: Pos
    pattern: Str
    word: Name


Item = Assign | Directive


@dataclass(frozen=True, slots=True)
class Section:
    """`keyword [argument] { items }`; `argument` is the model family or factory."""

    keyword: str
    keyword_pos: Pos
    argument: Name | Str | None
    items: tuple[Item, ...]
    pos: Pos


@dataclass(frozen=True, slots=True)
class PlanFile:
    """A whole plan file: its sections in order, and where the file ends."""

    sections: tuple[Section, ...]
    end: Pos


def value_kind(node: Value) -> str:
    """A few words naming what kind of value `node` is, for error messages."""
    return {
        Int: "an integer", Float: "a number", Quantity: "a quantity with a unit",
        Str: "a string", Name: "a name", Range: "a range", Call: "a call",
        Tuple: "a tuple", List: "a list", Invalid: "an invalid value",
    }[type(node)]
