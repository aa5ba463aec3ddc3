"""Build one plan dataclass from read values, keeping its errors as diagnostics.

Plan sections validate themselves and raise `PlanError`. The DSL wants all
problems of a file, so it builds each section even when some keys were
wrong or missing — those get a harmless *placeholder* — collects what the
section reports, and drops reports about the placeholders (the user has
already been told about those keys).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from ptc.dsl.source import Source
from ptc.dsl.values import INVALID
from ptc.errors import PlanError


def construct(make: Callable[..., Any], values: dict[str, Any], source: Source,
              placeholders: Collection[str] = ()) -> Any:
    """`make(**values)`, or INVALID after recording its diagnostics in `source`.

    `placeholders` names the fields filled in only so that construction can
    run; diagnostics about them are dropped.
    """
    try:
        return make(**values)
    except PlanError as exc:
        for diagnostic in exc.diagnostics:
            if diagnostic.field.rsplit(".", 1)[-1] not in placeholders:
                source.sink.items.append(diagnostic)
        return INVALID
