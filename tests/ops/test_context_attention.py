"""Context-parallel attention: equal to the whole sequence's causal attention, computing
only the query-key products before each query chunk's end.

Four gloo processes, as cp 4 and as two groups of cp 2, each hold their two
chunks of every sample's positions; each computes `context_attention` on
them (fused and written out, grouped-query heads, a scale, keyed dropout)
and compares its output and its q, k, v gradients with its positions of the
whole sequence's causal attention, which every rank computes itself from the
same seed. Everything runs in float64: both sides form each output as the
same softmax-weighted sum over at most S = 32 keys, summed in another order
(chunks of keys, other blocking), so they differ by float64 rounding, a few
ulps times S; the bound 1e-12 of the largest magnitude is ~4500 ulps, far
below any masking or ordering mistake (which is O(1)).

The query-key products each rank's forward computes (written out: torch's
FlopCounterMode; fused: the shapes the kernel is given, half where it runs
causal) are `key_tile_share(cp)` of the whole sequence's, the share the cost
model prices.
"""

from __future__ import annotations

import pytest

from ptc.ops.context import key_tile_share
from ptc.runtime.launcher import run_local
from tests.ops.cp_op_worker import run_cases

TOL = 1e-12
WORLD = 4

CASES = {
    "cp2 fused": {"cp": 2, "fused": True, "heads": 4, "kv_heads": 4, "scale": None,
                  "dropout": 0.0},
    "cp4 fused": {"cp": 4, "fused": True, "heads": 4, "kv_heads": 4, "scale": None,
                  "dropout": 0.0},
    "cp2 written out": {"cp": 2, "fused": False, "heads": 4, "kv_heads": 4, "scale": 0.3,
                        "dropout": 0.0},
    "cp4 grouped-query, written out": {"cp": 4, "fused": False, "heads": 4, "kv_heads": 2,
                                       "scale": None, "dropout": 0.0},
    "cp4 grouped-query, fused": {"cp": 4, "fused": True, "heads": 4, "kv_heads": 2,
                                 "scale": 0.3, "dropout": 0.0},
    "cp2 keyed dropout": {"cp": 2, "fused": True, "heads": 4, "kv_heads": 4, "scale": None,
                          "dropout": 0.25},
    "cp4 keyed dropout, grouped-query": {"cp": 4, "fused": True, "heads": 4, "kv_heads": 2,
                                         "scale": None, "dropout": 0.25},
}
SHAPE = {"batch": 2, "seq": 32, "dim": 8}

_runs: dict[str, list[dict]] = {}


def _results(name: str) -> list[dict]:
    """Every rank's result for case `name` (one launch for all cases)."""
    if not _runs:
        cases = [{**SHAPE, **case, "seed": i} for i, case in enumerate(CASES.values())]
        by_rank = run_local(run_cases, WORLD, cases)
        _runs.update({n: [by_rank[r][i] for r in range(WORLD)] for i, n in enumerate(CASES)})
    return _runs[name]


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_whole_sequences_causal_attention(name: str) -> None:
    for rank, got in enumerate(_results(name)):
        gaps = {k: got[k] for k in ("out", "q", "k", "v")}
        assert all(g <= TOL for g in gaps.values()), f"{name}, rank {rank}: gaps {gaps}"


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not c["dropout"]])
def test_each_rank_multiplies_only_the_keys_before_its_chunks(name: str) -> None:
    case = CASES[name]
    whole = SHAPE["batch"] * case["heads"] * SHAPE["seq"] ** 2  # every tile of the sequence
    products = [got["products"] for got in _results(name)]
    share = key_tile_share(case["cp"])
    # the first chunk of each group's first rank, the only square one, runs causal
    chunk = SHAPE["seq"] // (2 * case["cp"])
    skipped = SHAPE["batch"] * case["heads"] * chunk ** 2 / 2 if case["fused"] else 0
    assert products == [share * whole - (skipped if rank % case["cp"] == 0 else 0)
                        for rank in range(WORLD)]
