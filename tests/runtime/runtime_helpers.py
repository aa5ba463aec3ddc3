"""Shared helpers of the runtime tests: the tiny plans and eager reference of tests/distributed."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "tests" / "distributed"):
    if str(path) not in sys.path:  # plain `pytest` does not put these on the path
        sys.path.insert(0, str(path))

from dist_helpers import MODELS, reference, tiny_plan  # noqa: E402

__all__ = ["MODELS", "ROOT", "reference", "tiny_plan"]
