"""The rooms of the code import only the rooms below them (DESIGN.md, "Rooms").

Every import statement of every module is read with `ast` — at the top, in
functions and under TYPE_CHECKING alike — and checked against the table
below; a crossing fails naming the module, the line and the room it reached.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ptc"

BOTTOM = ("ptc.errors", "ptc.units", "ptc.presets", "ptc.hwprofile", "ptc.plan", "ptc.checks")
"""The plan's own rooms: errors, units, hardware presets and profiles, dataclasses and their
checks."""

COMPILER_ORDER = ("schedule", "records", "graph", "capture", "profile", "memory", "cost",
                  "search")
"""The compiler's subpackages from the bottom up: the schedule IR, the pure records, facts
read off graphs, capture, profiles, the memory model, the cost model, estimate and search."""

MAX_COMPILER_TOP = 8
"""Modules allowed at the top of `ptc/compiler/` (its subpackages aside)."""

ROOMS = {
    # room prefix: the ptc rooms it may import (besides itself)
    "ptc.errors": (),
    "ptc.units": (),
    "ptc.presets": ("ptc.units",),
    "ptc.hwprofile": ("ptc.errors",),
    "ptc.checks": ("ptc.errors", "ptc.plan", "ptc.units", "ptc.presets"),
    "ptc.plan": BOTTOM,
    "ptc.dsl": BOTTOM,
    "ptc.models": BOTTOM,
    "ptc.ops": BOTTOM,
    # The compiler's subpackages, bottom up (COMPILER_ORDER): each imports only those below.
    **{f"ptc.compiler.{sub}": (*BOTTOM, "ptc.ops", *(f"ptc.compiler.{below}" for below in
                                                     COMPILER_ORDER[:i]))
       for i, sub in enumerate(COMPILER_ORDER)},
    # The compiler's own top (collector, shapes): the plan's rooms only.
    "ptc.compiler": BOTTOM,
    "ptc.passes": (*BOTTOM, "ptc.compiler", "ptc.ops"),
    "ptc.lower": (*BOTTOM, "ptc.models", "ptc.compiler", "ptc.ops", "ptc.passes"),
    # Preflight plans (it estimates, builds models, compiles through the compiler it is
    # handed) and asks the runtime's own readers whether a run would find its token file,
    # weights and mesh: the one module of a planning room that reads the runtime.
    "ptc.lower.preflight": (*BOTTOM, "ptc.models", "ptc.compiler", "ptc.ops", "ptc.runtime"),
    # The runtime runs a Program and a resolved Plan: it never reads plan text (dsl), builds
    # a model (models: a factory is handed in) or compiles (lower: a compiler is handed in).
    "ptc.runtime": (*BOTTOM, "ptc.ops", "ptc.compiler"),
    # What people read: a Program's decisions, rendered (and a run's measured collectives).
    "ptc.views": (*BOTTOM, "ptc.ops", "ptc.compiler", "ptc.lower", "ptc.runtime"),
}
"""Rooms from the bottom up; `ptc.cli`, `ptc.api`, `ptc.worker` and `ptc` may import all."""

TORCH_FREE = ("ptc.errors", "ptc.units", "ptc.presets", "ptc.hwprofile", "ptc.plan",
              "ptc.checks", "ptc.dsl")
"""Rooms that must load without torch: `ptc check` answers before torch is imported."""


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out.append((name, path))
    return out


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
            # `from ptc import compiler` imports the submodule ptc.compiler.
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names
                         if base == "ptc")
    return found


def _room(module: str) -> str | None:
    for room in sorted(ROOMS, key=len, reverse=True):
        if module == room or module.startswith(room + "."):
            return room
    return None


def _in(module: str, rooms: tuple[str, ...]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in rooms)


MODULES = _modules()


def test_every_module_is_in_a_room_or_at_the_top() -> None:
    top = {"ptc", "ptc.cli", "ptc.api", "ptc.worker", "ptc.__main__"}
    homeless = [name for name, _ in MODULES if _room(name) is None and name not in top]
    assert not homeless, f"modules in no room of tests/test_rooms.py: {homeless}"


@pytest.mark.parametrize("name,path", MODULES, ids=[name for name, _ in MODULES])
def test_imports_stay_in_the_rooms_below(name: str, path: Path) -> None:
    room = _room(name)
    if room is None:
        return  # the top: cli, api, worker
    allowed = (room, *ROOMS[room])
    crossings = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module} "
                 f"(room {_room(module) or module}; {room} may import {', '.join(allowed)})"
                 for line, module in _imports(path)
                 if module.split(".")[0] == "ptc" and module != "ptc" and not _in(module, allowed)]
    if _in(name, TORCH_FREE):
        crossings += [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module} "
                      f"(room {room} must not need torch)"
                      for line, module in _imports(path) if module.split(".")[0] == "torch"]
    assert not crossings, "\n".join(crossings)


def test_the_compiler_keeps_few_modules_at_its_top() -> None:
    top = [p.name for p in (PACKAGE / "compiler").glob("*.py")]
    assert len(top) <= MAX_COMPILER_TOP, f"ptc/compiler/ holds {sorted(top)} at its top"


def test_every_compiler_subpackage_is_in_the_order() -> None:
    subpackages = {p.parent.name for p in (PACKAGE / "compiler").glob("*/__init__.py")}
    assert subpackages == set(COMPILER_ORDER)
