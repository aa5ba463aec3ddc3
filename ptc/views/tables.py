"""What a person reads at any width: tables with every cell whole, and prose wrapped.

`FitTable` is built like a rich `Table` (columns, then rows of strings). At
render time it sizes its columns against the console's width itself: a text
column may wrap at spaces down to its longest word, a number column keeps
each cell on one line (its header may wrap). When that narrowest form fits,
it prints as a table; else, when the table turned (a row per column) fits,
as that; otherwise each row becomes a block of `header  value` lines under
the row's first cell. Its title is `Prose` above it.

`Prose` is text wrapped at the console's width between words, never inside
one: a number, a path or a formula term is never cut to "3.…" or broken over
two lines. The `ptc` console prints with soft wrapping (rich then wraps
nothing itself), so every line ptc prints is either a table sized here or
prose wrapped here, and fits an 80-column terminal or a file piped at 80.
"""

from __future__ import annotations

import re
import textwrap

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

GLUE = "\u00a0"
"""A no-break space: `Prose` never breaks a line there (printed as a plain space)."""

_UNIT = re.compile(r"(?<=\d) (?=(?:[KMGTPE]i?B|B|[mun]?s|[KMGTP]?FLOP)\b)")
"""The space between a number and its unit ("2.1 MiB", "5.0 us"): kept on one line."""


def wrap(text: str, width: int, indent: int = 2) -> list[str]:
    """`text`'s lines wrapped at `width` between words; a wrapped line goes on `indent`
    spaces deeper than its first. A word longer than the width stays whole on its own line
    (a reader can scroll a long path; a cut one is wrong). `GLUE` and the space between a
    number and its unit never break."""
    out: list[str] = []
    for line in text.split("\n"):
        lead = line[:len(line) - len(line.lstrip(" "))]
        glued = _UNIT.sub(GLUE, line.strip(" "))
        out += textwrap.wrap(glued, max(width, 1), initial_indent=lead,
                             subsequent_indent=lead + " " * indent, break_long_words=False,
                             break_on_hyphens=False) or [""]
    return [line.replace(GLUE, " ") for line in out]


class Prose:
    """Text that wraps at the console's width (see `wrap`), as a rich renderable."""

    def __init__(self, text: str, *, indent: int = 2, style: str = "") -> None:
        """`indent`: how much deeper a wrapped line goes; `style`: rich style of the text."""
        self.text, self.indent, self.style = text, indent, style

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Text("\n".join(wrap(self.text, options.max_width, self.indent)), style=self.style)


class FitTable:
    """A table of string cells that keeps every cell whole (the module docstring)."""

    def __init__(self, title: str | None = None, *, show_header: bool = True,
                 plain: bool = False) -> None:
        """`plain`: no box and no header line (a key/value list). Without a header the first
        column is the key and prints bold."""
        self.title, self.show_header, self.plain = title, show_header, plain
        self.columns: list[tuple[str, str, bool]] = []
        self.rows: list[tuple[str, ...]] = []
        self.styles: list[str | None] = []

    def add_column(self, header: str = "", *, justify: str = "left",
                   number: bool | None = None) -> None:
        """A column; `number` (default: right-justified) keeps its cells on one line (its
        header may wrap)."""
        self.columns.append((header, justify, justify == "right" if number is None else number))

    def add_row(self, *cells: str, style: str | None = None) -> None:
        """A row, one string per column; `style` (rich) colours it in the table forms."""
        self.rows.append(tuple(cells))
        self.styles.append(style)

    def headed(self) -> bool:
        """Whether the table prints its header row."""
        return self.show_header and not self.plain

    def column_widths(self, width: int) -> list[int] | None:
        """Content width of each column so that the table, borders and padding included, is
        at most `width` wide; None when even the narrowest columns are wider.

        Each column starts at its widest line; the widest column still above its narrowest
        form (its longest word; a number column's longest cell) gives up a character at a
        time, so the columns that wrap are the long ones and none is cut.
        """
        ranges = [self._range(i) for i in range(len(self.columns))]
        room = width - self._overhead()
        if sum(low for low, _ in ranges) > room:
            return None
        widths = [high for _, high in ranges]
        while sum(widths) > room:
            i = max((i for i, (low, _) in enumerate(ranges) if widths[i] > low),
                    key=lambda i: widths[i])
            widths[i] -= 1
        return widths

    def _range(self, i: int) -> tuple[int, int]:
        """(narrowest, widest) content width of column `i`."""
        header, _, number = self.columns[i]
        cells = [row[i] for row in self.rows]
        texts = cells + ([header] if self.headed() else [])
        words = [cell_len(w) for text in texts for w in text.split()]
        if number:
            words += [cell_len(cell) for cell in cells]
        return max(words, default=0), max((cell_len(t) for t in texts), default=0)

    def _overhead(self) -> int:
        """Columns of padding (one space either side of a cell, rich's default) and rules
        (one between cells and one at each edge, boxed only)."""
        n = len(self.columns)
        return 2 * n + (0 if self.plain else n + 1)

    def _table(self, widths: list[int]) -> Table:
        """The rich Table of the columns and rows at these column widths."""
        table = Table(show_header=self.headed(), box=None if self.plain else box.HEAVY_HEAD,
                      header_style="bold")
        for i, ((header, justify, _), width) in enumerate(zip(self.columns, widths)):
            key = i == 0 and not self.headed()
            table.add_column(header, justify=justify, width=width, style="bold" if key else None)
        for row, style in zip(self.rows, self.styles):
            table.add_row(*map(Text, row), style=style)  # Text: a cell's "[" is not markup
        return table

    def transposed(self) -> FitTable | None:
        """The table turned: a row per column, a column per row (headed by its first cell);
        None for a key/value list or a table without rows."""
        if self.plain or not self.rows:
            return None
        turned = FitTable(self.title)
        turned.add_column(self.columns[0][0], justify="left", number=False)
        numbers = all(number for _, _, number in self.columns[1:])
        for row in self.rows:
            turned.add_column(row[0], justify="right" if numbers else "left", number=numbers)
        for i, (header, _, _) in enumerate(self.columns[1:], start=1):
            turned.add_row(header, *(row[i] for row in self.rows))
        return turned

    def stacked(self, width: int) -> Text:
        """Each row as a block wrapped at `width`: its first cell, then `header  value` for
        the others that are not empty."""
        headers = [header for header, _, _ in self.columns]
        pad = max((len(h) for h in headers[1:]), default=0)
        lines = wrap(self.title, width) if self.title else []
        for row in self.rows:
            if self.plain:
                lines += wrap(f"{row[0]}: {'  '.join(row[1:])}", width)
                continue
            lines += wrap(f"{headers[0]} {row[0]}".strip(), width)
            for header, cell in zip(headers[1:], row[1:]):
                if cell:
                    lines += wrap(f"  {header:<{pad}}  {cell}", width, indent=pad + 2)
        return Text("\n".join(lines))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        for candidate in (self, self.transposed()):
            widths = candidate.column_widths(width) if candidate is not None else None
            if widths is not None:
                if self.title:
                    yield Prose(self.title, style="table.title")
                yield candidate._table(widths)
                return
        yield self.stacked(width)
