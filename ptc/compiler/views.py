"""Tables that a person reads at any width: every cell whole, or the rows stacked.

`FitTable` is built like a rich `Table` (columns, then rows of strings). At
render time it measures itself against the console's width: when its
narrowest form fits (text columns wrapped at spaces, number columns kept on
one line), it prints as a table; else, when the table turned (a row per
column) fits, as that; otherwise each row becomes a block of `header  value`
lines under the row's first cell (rich's own measure of
the table, with each number column at least as wide as its widest cell). Nothing is ever cut to
"optimi…" or "3.…", piped into a file or shown on an 80-column terminal.
"""

from __future__ import annotations

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text


class FitTable:
    """A table of string cells that keeps every cell whole (the module docstring)."""

    def __init__(self, title: str | None = None, *, show_header: bool = True,
                 plain: bool = False) -> None:
        """`plain`: no box and no header line (a key/value list)."""
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

    def table(self) -> Table:
        """The rich Table of the columns and rows."""
        table = Table(title=self.title, show_header=self.show_header and not self.plain,
                      box=None if self.plain else box.HEAVY_HEAD, header_style="bold")
        for i, (header, justify, number) in enumerate(self.columns):
            widest = max((len(row[i]) for row in self.rows), default=0) if number else None
            table.add_column(header, justify=justify, min_width=widest,
                             style="bold" if self.plain and i == 0 else None)
        for row, style in zip(self.rows, self.styles):
            table.add_row(*row, style=style)
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

    def stacked(self) -> Text:
        """Each row as a block: its first cell, then `header  value` for the others that are
        not empty."""
        headers = [header for header, _, _ in self.columns]
        pad = max((len(h) for h in headers[1:]), default=0)
        lines = [self.title] if self.title else []
        for row in self.rows:
            first = f"{headers[0]} {row[0]}".strip() if not self.plain else row[0]
            if self.plain:
                lines.append(f"{first}: {'  '.join(row[1:])}")
                continue
            lines.append(first)
            lines += [f"  {h:<{pad}}  {cell}" for h, cell in zip(headers[1:], row[1:]) if cell]
        return Text("\n".join(lines))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        turned = self.transposed()
        for candidate in (self, turned):
            if candidate is None:
                continue
            table = candidate.table()
            # the table's own measure: Measurement.get would clamp the minimum to the width
            if table.__rich_measure__(console, options).minimum <= options.max_width:
                yield table
                return
        yield self.stacked()

