"""docs/plan-language.md stays in step with the schema, and its example parses."""

from __future__ import annotations

import re

import pytest
from dsl_helpers import ROOT

from ptc.dsl import parse
from ptc.dsl.schema import SECTIONS

DOC = (ROOT / "docs" / "plan-language.md").read_text()


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_key_is_documented(section: str) -> None:
    part = DOC.split(f"### {section}\n", 1)[1].split("\n### ", 1)[0]
    missing = [key for key in SECTIONS[section] if f"| `{key}` |" not in part]
    assert not missing, f"{section}: keys not documented: {missing}"


def test_the_example_in_the_docs_parses() -> None:
    example = re.search(r"```ptc\n(.*?)```", DOC, flags=re.S)[1]
    plan = parse(example, "docs/plan-language.md")
    assert plan.model.family == "llama" and plan.parallel.tp == 2
