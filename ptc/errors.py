"""Errors ptc raises, and the diagnostics they carry.

A *diagnostic* is one problem found in a plan: a message, where it is (file,
line, column, or a dotted field path for plans built in Python), the valid
choices, and a severity. A `PlanError` carries every error diagnostic of one
plan so a user fixes them all in one go; warnings travel beside a valid plan.
Every error ptc raises derives from `PtcError`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    """A place in a plan file: 1-based line and column, and the source line."""

    file: str
    """Path of the plan file as the user gave it (or "<string>")."""
    line: int
    """1-based line number."""
    column: int
    """1-based column of the first character."""
    end_column: int | None = None
    """1-based column just past the last character on the same line, if known."""
    source_line: str = ""
    """The text of the line, for the caret display."""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Diagnostic:
    """One problem in a plan, with where it is and what would be valid."""

    message: str
    """What is wrong, naming the offending values."""
    field: str = ""
    """Dotted path of the plan field, e.g. "parallel.tp"."""
    span: Span | None = None
    """Where in the plan file, when the plan came from a file."""
    choices: tuple[str, ...] = ()
    """The valid choices, when there is a small set of them."""
    severity: str = "error"
    """"error" or "warning"."""

    def render(self) -> str:
        """Format as `file:line:col: error: message`, the line, a caret, the choices."""
        where = str(self.span) if self.span else (self.field or "plan")
        text = f"{where}: {self.severity}: {self.message}"
        if self.span and self.field:
            text += f" [{self.field}]"
        if self.span and self.span.source_line:
            width = max(1, (self.span.end_column or self.span.column + 1) - self.span.column)
            text += f"\n    {self.span.source_line.rstrip()}"
            text += "\n    " + " " * (self.span.column - 1) + "^" * width
        if self.choices:
            text += "\n    valid: " + ", ".join(self.choices)
        return text


class PtcError(Exception):
    """Base class of every error ptc raises on purpose."""


class PlanError(PtcError):
    """A plan is invalid; `diagnostics` lists every error found, in source order."""

    def __init__(self, diagnostics: list[Diagnostic] | tuple[Diagnostic, ...]):
        self.diagnostics = tuple(diagnostics)
        super().__init__("\n".join(d.render() for d in self.diagnostics))


class UnpricedError(PtcError):
    """ptc can compile and run the plan but cannot predict its memory or step time (the
    message says why); the run goes on without predictions."""


class CaptureError(PtcError):
    """A model could not be captured as an fx graph; the message says how to fix it."""


class CompileError(PtcError):
    """A compiler pass failed; the message names the pass and the node.

    `pass_name`: the pass that failed, where one did; `field`: the plan field
    ("parallel.tp") that asked for that pass, where the driver knows it, so a
    check before the run can point at it.
    """

    def __init__(self, message: str, *, pass_name: str | None = None,
                 field: str | None = None):
        super().__init__(message)
        self.pass_name, self.field = pass_name, field


@dataclass(slots=True)
class DiagnosticSink:
    """Collects diagnostics so that all problems of a plan are reported together."""

    items: list[Diagnostic] = field(default_factory=list)

    def error(self, message: str, *, field: str = "", span: Span | None = None,
              choices: tuple[str, ...] | list[str] = ()) -> None:
        """Record an error."""
        self.items.append(Diagnostic(message=message, field=field, span=span,
                                     choices=tuple(choices)))

    def warning(self, message: str, *, field: str = "", span: Span | None = None) -> None:
        """Record a warning (the plan stays valid)."""
        self.items.append(Diagnostic(message=message, field=field, span=span,
                                     severity="warning"))

    @property
    def errors(self) -> list[Diagnostic]:
        """The error diagnostics, sorted by position in the file."""
        errs = [d for d in self.items if d.severity == "error"]
        return sorted(errs, key=_source_order)

    @property
    def warnings(self) -> list[Diagnostic]:
        """The warning diagnostics."""
        return [d for d in self.items if d.severity == "warning"]

    def raise_if_errors(self) -> None:
        """Raise one `PlanError` holding every error recorded so far."""
        if self.errors:
            raise PlanError(self.errors)


def did_you_mean(word: str, choices: Iterable[str], cutoff: float = 0.6) -> str:
    """"; did you mean 'x'?" when a choice is close to `word`, else ""."""
    # Case-insensitive first: `BF16` for `bf16` is the most common slip.
    options = [str(c) for c in choices]
    lowered = {c.lower(): c for c in options}
    if word.lower() in lowered and lowered[word.lower()] != word:
        return f"; did you mean '{lowered[word.lower()]}'?"
    # A unique completion beats a near miss: "H100" means "H100-SXM", not "H200".
    longer = [c for c in options if word and c.lower().startswith(word.lower()) and c != word]
    if len(longer) == 1:
        return f"; did you mean '{longer[0]}'?"
    close = difflib.get_close_matches(word, options, n=1, cutoff=cutoff)
    return f"; did you mean '{close[0]}'?" if close else ""


def _source_order(d: Diagnostic) -> tuple:
    if d.span is None:
        return (1, 0, 0, d.field)
    return (0, d.span.line, d.span.column, d.field)
