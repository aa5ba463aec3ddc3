"""The ptc plan language: parse `.ptc` files into `Plan`s and write them back.

Three steps (DESIGN convention 6): the lark grammar `ptc/grammar.lark`
turns text into a tree, `ptc.dsl.syntax` turns the tree into AST
dataclasses with positions, and `ptc.dsl.semantic` checks the AST against
the section tables of `ptc.dsl.schema` and builds the `Plan`, whose own
checks then run. Every problem of a file comes back in one `PlanError`,
each with file, line, column, a caret and the valid choices.

Public API: `parse(text, file)`, `load_plan(path)`, `dump_plan(plan)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ptc.dsl.dump import dump_plan
from ptc.dsl.overrides import apply_overrides, relabel
from ptc.dsl.paths import resolve_paths
from ptc.dsl.semantic import build_plan
from ptc.dsl.source import Source
from ptc.dsl.syntax import parse_syntax
from ptc.errors import Diagnostic, PlanError, PtcError
from ptc.plan import Plan

__all__ = ["dump_plan", "load_plan", "parse"]

MAX_PLAN_CHARS = 4 * 2**20
"""Plans are a few kilobytes; refuse anything absurdly large before parsing it."""


def parse(text: str, file: str = "<string>",
          overrides: Mapping[str, object] | None = None) -> Plan:
    """Parse plan text into a checked `Plan`.

    `file` names the text in diagnostics and becomes `Plan.source`.
    `overrides`: {"parallel.tp": 4, "runtime.checkpoint_dir": "ckpt"} set
    those keys as if written in the file (`ptc.dsl.overrides`). Raises
    `PlanError` listing every problem found (sorted by position; an
    override's under its `--section.key`); nothing but a `PtcError` escapes.
    """
    if not isinstance(text, str):
        raise PtcError(f"plan text must be a str, got {type(text).__name__}")
    if len(text) > MAX_PLAN_CHARS:
        raise PlanError([Diagnostic(message=f"plan is {len(text)} characters long; plans "
                                            f"are limited to {MAX_PLAN_CHARS}", field=str(file))])
    source = Source(file=str(file), text=text.removeprefix("\ufeff"))
    try:
        tree = parse_syntax(source)
        source.sink.raise_if_errors()
        assert tree is not None
        if overrides:
            tree = apply_overrides(tree, overrides)
            try:
                return build_plan(tree, source)
            except PlanError as exc:
                raise relabel(exc, overrides) from None
        return build_plan(tree, source)
    except PtcError:
        raise
    except Exception as exc:  # noqa: BLE001 - the promise above
        # A bug in ptc, not in the plan; still reported as a plan error with
        # what was found so far, so callers handle one kind of exception.
        source.sink.error(f"internal error while checking the plan: "
                          f"{type(exc).__name__}: {exc}", field="plan")
        raise PlanError(source.sink.errors) from exc


def load_plan(path: str | Path, overrides: Mapping[str, object] | None = None) -> Plan:
    """Read and parse the plan file at `path` (UTF-8), with `overrides` of its fields
    (see `parse`); `Plan.source` is the path. Relative file paths written in the plan
    resolve against its folder (`ptc.dsl.paths`).

    A missing, unreadable or non-UTF-8 file raises `PtcError`; an invalid
    plan raises `PlanError`.
    """
    name = str(path)
    try:
        data = Path(path).read_bytes()
    except (OSError, ValueError) as exc:  # ValueError: e.g. a NUL in the path
        reason = getattr(exc, "strerror", None) or str(exc)
        raise PtcError(f"cannot read plan file {name}: {reason}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PtcError(f"plan file {name} is not UTF-8 text (byte {exc.start} is "
                       f"0x{data[exc.start]:02x})") from None
    return resolve_paths(parse(text, file=name, overrides=overrides), Path(path).parent)
