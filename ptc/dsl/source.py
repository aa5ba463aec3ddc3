"""The text of one plan file and the diagnostics found in it.

A `Source` turns AST positions into `Span`s (file, line, column, the line's
text for the caret) and collects every diagnostic of the file in one
`DiagnosticSink`, so that all problems are reported together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ptc.dsl.ast import Pos
from ptc.errors import DiagnosticSink, Span

MAX_SHOWN_LINE = 200
"""Longer source lines are cut in diagnostics so a minified file stays readable."""


NOWHERE = Pos(10**9, 1, 10**9, 2)
"""The position of text that is not in the file (a command-line override): no span."""


@dataclass(slots=True)
class Source:
    """One plan file being parsed: its name, its lines, its diagnostics."""

    file: str
    text: str
    lines: list[str] = field(init=False)
    sink: DiagnosticSink = field(default_factory=DiagnosticSink)

    def __post_init__(self) -> None:
        # Split on "\n" only: lark counts lines the same way, so a stray
        # "\r" or form feed cannot shift line numbers between the two.
        self.lines = self.text.split("\n")

    def span(self, pos: Pos | None) -> Span | None:
        """The `Span` of `pos` (None stays None)."""
        if pos is None or pos.line >= NOWHERE.line:
            return None
        line = min(max(pos.line, 1), len(self.lines))
        text = self.lines[line - 1]
        end = pos.end_column if pos.end_line == pos.line and pos.end_column > pos.column else None
        if len(text) > MAX_SHOWN_LINE:
            text = text[:MAX_SHOWN_LINE]
            if end is not None and end > MAX_SHOWN_LINE + 1:
                end = None
        return Span(file=self.file, line=line, column=max(pos.column, 1), end_column=end,
                    source_line=text)

    def error(self, message: str, pos: Pos | None, *, field: str = "",
              choices: tuple[str, ...] | list[str] = ()) -> None:
        """Record an error at `pos`."""
        self.sink.error(message, field=field, span=self.span(pos), choices=tuple(choices))

    def end_pos(self) -> Pos:
        """The position just past the last character of the file."""
        last = len(self.lines)
        col = len(self.lines[-1]) + 1
        return Pos(last, col, last, col)
