"""The profile cache's file format: a profile as JSON data, read back without running code.

A profile is kept on disk between processes (`ptc.compiler.profile.cache`).
Its file is data only: every sympy expression of a profile is a polynomial in
b and s with rational coefficients (`ptc.compiler.profile.fit`), written as
its terms `[i, j, "p/q"]` (the coefficient of b^i·s^j); numbers, strings,
tuples, sets, dicts and the profile's own record types are written by name
and field. Reading builds only those types, so a file planted in the cache
runs nothing, and one that is damaged or of another version reads as no
file (`Unreadable`): the profile is computed again.
"""

from __future__ import annotations

import dataclasses
import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import sympy

from ptc.compiler.graph.gemm_tiles import GemmShape
from ptc.compiler.profile.types import ModelProfile, ParamGroups, SavedClasses, Unprofiled, b, s
from ptc.plan import ModelSpec

VERSION = 1
"""The format's version: a file of another one is not read."""

_RECORDS = {cls.__name__: cls for cls in (ModelProfile, ParamGroups, SavedClasses, Unprofiled,
                                          GemmShape, ModelSpec)}
"""The record types a file may name, by class name: nothing else is built from one."""

_SKIPPED = {"fn", "memo", "spans"}
"""Fields not kept: a profile's compiled functions and memo (made again on reading) and a
model spec's places in a plan file."""


class Unreadable(Exception):
    """A cache file that is damaged, of another format, or names what it may not."""


def write_profile(path: Path, profile: ModelProfile | Unprofiled) -> None:
    """Write `profile` to `path` atomically: a concurrent reader sees no file or the whole
    new one. TypeError when it holds a value this format cannot keep."""
    text = json.dumps({"version": VERSION, "profile": _encode(profile)})
    tmp = path.with_name(f"{path.name}.{id(text)}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def read_profile(path: Path) -> ModelProfile | Unprofiled:
    """The profile kept at `path`; Unreadable when the file cannot be one."""
    try:
        stored = json.loads(path.read_text())
        if not isinstance(stored, dict) or stored.get("version") != VERSION:
            raise Unreadable(f"{path}: not a profile of format {VERSION}")
        profile = _decode(stored["profile"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError) as exc:
        raise Unreadable(f"{path}: {type(exc).__name__}: {exc}") from None
    if not isinstance(profile, (ModelProfile, Unprofiled)):
        raise Unreadable(f"{path}: holds a {type(profile).__name__}, not a profile")
    return profile


def _encode(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, sympy.Expr):
        return {"poly": _terms(value)}
    if isinstance(value, Fraction):
        return {"fraction": str(value)}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, frozenset):
        return {"frozenset": sorted((_encode(v) for v in value), key=json.dumps)}
    if isinstance(value, dict) or type(value).__name__ == "mappingproxy":
        return {"dict": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if type(value).__name__ in _RECORDS and dataclasses.is_dataclass(value):
        return {"record": type(value).__name__,
                "fields": {f.name: _encode(getattr(value, f.name))
                           for f in dataclasses.fields(value) if f.name not in _SKIPPED}}
    raise TypeError(f"a profile cannot keep a {type(value).__name__} on disk")


def _terms(expr: sympy.Expr) -> list[list]:
    """The polynomial's terms [i, j, "p/q"] (coefficient of b^i·s^j)."""
    poly = sympy.Poly(expr, b, s)
    terms = []
    for (i, j), coefficient in poly.terms():
        if not coefficient.is_Rational:
            raise TypeError(f"a profile keeps polynomials of rational coefficients, not {expr}")
        terms.append([int(i), int(j), str(coefficient)])
    return terms


def _decode(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict) or len(value) not in (1, 2):
        raise ValueError(f"not a value of the format: {str(value)[:80]}")
    if "poly" in value:
        return sympy.Add(*(sympy.Rational(c) * b**int(i) * s**int(j) for i, j, c in value["poly"]))
    if "fraction" in value:
        return Fraction(value["fraction"])
    if "tuple" in value:
        return tuple(_decode(v) for v in value["tuple"])
    if "frozenset" in value:
        return frozenset(_decode(v) for v in value["frozenset"])
    if "dict" in value:
        return {_decode(k): _decode(v) for k, v in value["dict"]}
    if "record" in value:
        cls = _RECORDS[value["record"]]
        return cls(**{name: _decode(v) for name, v in value["fields"].items()})
    raise ValueError(f"not a value of the format: {str(value)[:80]}")
