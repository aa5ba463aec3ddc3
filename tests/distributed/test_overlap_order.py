"""Every rank of a group issues the same collectives in the same order, overlap and buckets on.

Four gloo processes train the tiny GPT (dp = 4) at ZeRO 1, 2 and 3 with the
comm_overlap pass's buckets and prefetch; each rank logs every collective
the runtime issues (op, group, elements). Autograd hooks, backward
prefetches and deferred reductions all decide at run time when to issue, so
this is the check that matters: a rank whose sequence differs would hang
gloo or NCCL, or mix up data.
"""

from __future__ import annotations

import pytest
from overlap_worker import log_collectives

from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed

ZEROS = [1, 2, 3]
_run: dict = {}


def _results() -> dict:
    if not _run:
        _run.update(run_local(log_collectives, 4, ZEROS, 4)[0])
    return _run


@pytest.mark.timeout(240)
@pytest.mark.parametrize("zero", ZEROS)
def test_all_ranks_issue_the_same_collectives_in_the_same_order(zero: int) -> None:
    logs = _results()[zero]["logs"]
    assert logs[0], "no collective was recorded"
    for rank, log in enumerate(logs[1:], start=1):
        assert log == logs[0], f"rank {rank} issued a different sequence than rank 0"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("zero", ZEROS)
def test_each_bucket_is_reduced_by_one_collective(zero: int) -> None:
    got = _results()[zero]
    numels = got["bucket_numels"]
    assert len(numels) < got["units"], "the tiny model's small units should share buckets"
    steps, micro = 2, 2
    # ZeRO-2 and -3 reduce-scatter every micro-batch; ZeRO-1 after the last one only.
    op, times = "reduce_scatter", steps if zero == 1 else steps * micro
    sizes = set(numels)
    issued = [n for kind, _, n, _ in got["logs"][0] if kind == op and n in sizes]
    assert sorted(issued) == sorted(numels * times)
