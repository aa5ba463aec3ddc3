"""Where a profile captures a model: a 2 x 3 grid of micro-batches and sequence lengths
that fixes a polynomial {1, b} x {1, s, s^2}, and a fourth point that checks it, every
sequence below the model's max_seq (a table of max_seq rows sliced to the sequence is
sliced whole at max_seq, which the capture drops: GPT-Neo's causal bias)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
for extra in (ROOT, ROOT / "tests" / "distributed"):  # plain `pytest` puts neither on the path
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from hf_helpers import HFCase, hf_plan  # noqa: E402

from ptc.compiler.profile.fit import profile_points  # noqa: E402
from ptc.compiler.search.estimate import estimate  # noqa: E402


@pytest.mark.parametrize("max_seq", [5, 8, 16, 64, 65, 4096])
def test_every_point_lies_below_max_seq_on_a_grid_that_fixes_the_polynomial(max_seq) -> None:
    points = profile_points(max_seq)
    grid, check = points[:6], points[6]
    assert len({b for b, _ in grid}) == 2 and len({s for _, s in grid}) == 3
    assert check[0] not in {b for b, _ in grid} and check[1] not in {s for _, s in grid}
    assert all(0 < s < max_seq for _, s in points)


def test_a_model_slicing_a_max_seq_table_to_the_sequence_is_priced() -> None:
    est = estimate(hf_plan(HFCase("gpt_neo", dp=2)))
    assert est.step_time_s > 0 and est.peak_memory_bytes > 0
