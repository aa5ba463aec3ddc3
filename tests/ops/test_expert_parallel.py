"""Expert-parallel dispatch and combine: equal to one process computing every expert.

Two and four gloo processes each hold their own tokens (their own seeds),
route them to experts at random (or in stress patterns: every row to one
expert so that some ranks receive nothing, a rank with no tokens, one local
expert per rank, extra row-aligned tensors sent along), compute their local
experts' x @ W[e] on what `ep_dispatch` gave them and `ep_combine` the
result back. The reference concatenates all ranks' rows per expert in one
process. Everything runs in float64: both sides compute each output row as
the same length-d dot product and each weight gradient as the same sum over
the same rows, so they differ by at most float64 rounding of a different
blocking; the bound 1e-12 of the largest magnitude is ~5000 float64 ulps,
far below any routing mistake (which is O(1)).
"""

from __future__ import annotations

import pytest
import torch

from ptc.ops.comm import ShapeGroup, bind_axes, record_collectives
from ptc.ops.expert_parallel import ep_combine, ep_dispatch
from ptc.runtime.launcher import run_local
from tests.ops.ep_op_worker import run_cases

TOL = 1e-12

CASES = {
    2: {
        "random": {"experts": 4, "d": 3, "f": 5, "rows": [7, 11], "seed": 1},
        "one_expert": {"experts": 4, "d": 3, "f": 2, "rows": [5, 6], "seed": 2,
                       "routing": "one_expert"},
        "rank_sends_nothing": {"experts": 6, "d": 4, "f": 3, "rows": [9, 0], "seed": 3,
                               "offs_dtype": torch.float32},
        "extra_rows": {"experts": 4, "d": 3, "f": 4, "rows": [8, 5], "seed": 4,
                       "extra_rows": True, "offs_dtype": torch.int64},
    },
    4: {
        "one_local_expert": {"experts": 4, "d": 3, "f": 5, "rows": [6, 9, 4, 7], "seed": 5},
        "one_expert": {"experts": 8, "d": 2, "f": 3, "rows": [3, 4, 5, 2], "seed": 6,
                       "routing": "one_expert"},
        "rank_sends_nothing": {"experts": 8, "d": 3, "f": 2, "rows": [5, 0, 7, 3], "seed": 7,
                               "extra_rows": True},
    },
}

_runs: dict[int, dict] = {}


def _results(world: int) -> dict[str, list[dict]]:
    """{case: [rank's result]} for the cases of `world` processes (one launch per world)."""
    if world not in _runs:
        names = list(CASES[world])
        by_rank = run_local(run_cases, world, [CASES[world][n] for n in names])
        _runs[world] = {n: [by_rank[r][i] for r in range(world)] for i, n in enumerate(names)}
    return _runs[world]


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,name", [(w, n) for w in CASES for n in CASES[w]])
def test_dispatch_compute_combine_matches_one_process(world: int, name: str) -> None:
    case = CASES[world][name]
    for rank, got in enumerate(_results(world)[name]):
        where = f"{name}, rank {rank} of {world}"
        gaps = {k: got[k] for k in ("forward", "x", "w", "bias", "scale") if k in got}
        assert all(g <= TOL for g in gaps.values()), f"{where}: relative gaps {gaps}"
        assert got["ids_grouped"], f"{where}: a row reached the wrong local expert"
        assert got["grad_shape_ok"], f"{where}: x's gradient is missing or misshapen"
        assert got["offs_local_len"] == case["experts"] // world
        assert got["offs_dtype"] == str(case.get("offs_dtype", torch.int32))
        assert got["received"] == got["x_local_rows"]
        assert torch.tensor(got["route"]).shape == (world, case["experts"])
        assert got["route"] == _results(world)[name][0]["route"], "ranks disagree on the route"
        assert torch.tensor(got["route"]).sum(1).tolist() == case["rows"]


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,name", [(w, n) for w in CASES for n in CASES[w]])
def test_every_rank_issues_the_same_collectives(world: int, name: str) -> None:
    logs = [got["ops"] for got in _results(world)[name]]
    tensors = 1 + (3 if CASES[world][name].get("extra_rows") else 1)  # x, (bias, scale,) ids
    # forward: counts, each tensor out, y back; backward: y's grad out, x's (bias's, scale's)
    # back (ids get no gradient)
    differentiable = tensors - 1
    assert logs[0] == (["all_gather"] + ["all_to_all"] * tensors + ["all_to_all"]
                       + ["all_to_all"] * (1 + differentiable))
    assert all(log == logs[0] for log in logs)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_receiving_nothing_is_fine() -> None:
    got = _results(2)["one_expert"]
    assert got[0]["received"] == sum(CASES[2]["one_expert"]["rows"])
    assert got[1]["received"] == 0 and got[1]["w"] == 0.0


def _tokens(n=6, d=3, experts=4):
    x = torch.randn(n, d, requires_grad=True)
    offs = torch.tensor([1, 1, 4, n], dtype=torch.int32)[:experts]
    return x, offs


def test_unbound_axis_is_the_identity() -> None:
    x, offs = _tokens()
    ids = torch.arange(6)
    with bind_axes({}), record_collectives() as log:
        x_l, offs_l, route, ids_l = ep_dispatch(x, offs, ids, experts=4)
        y = ep_combine(x_l * 2, route)
    assert x_l is x and offs_l is offs and ids_l is ids
    assert route.dtype == torch.int64 and route.tolist() == [[1, 0, 3, 2]]
    assert torch.equal(y, x * 2) and log == []
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_shape_group_gives_balanced_shapes_on_meta() -> None:
    x = torch.empty(12, 5, device="meta", requires_grad=True)
    offs = torch.empty(8, dtype=torch.int32, device="meta")
    bias = torch.empty(12, 7, device="meta")
    with bind_axes({"ep": ShapeGroup(4)}):
        x_l, offs_l, route, bias_l = ep_dispatch(x, offs, bias, experts=8)
        assert x_l.shape == (12, 5) and x_l.is_meta and bias_l.shape == (12, 7)
        assert offs_l.shape == (2,) and offs_l.dtype == torch.int32
        assert route.shape == (4, 8) and route.dtype == torch.int64
        y = ep_combine(x_l @ torch.empty(5, 3, device="meta"), route)
        assert y.shape == (12, 3) and y.is_meta
        y.sum().backward()
    assert x.grad.shape == x.shape


def test_bad_arguments_say_what_is_wrong() -> None:
    x, offs = _tokens()
    with bind_axes({"ep": ShapeGroup(3)}), pytest.raises(ValueError, match="do not divide"):
        ep_dispatch(x, offs, experts=4)
    with pytest.raises(ValueError, match="expected \\[8\\]"):
        ep_dispatch(x, offs, experts=8)
    with pytest.raises(ValueError, match="rows\\[0\\] has 2 rows"):
        ep_dispatch(x, offs, torch.zeros(2), experts=4)


def test_ops_are_marked_as_collectives() -> None:
    assert all(len(op.ptc_collective) == 2 for op in (ep_dispatch, ep_combine))
