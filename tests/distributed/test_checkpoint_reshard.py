"""Checkpoints load under any layout: dp, ZeRO stage, tp and pp may all change.

Tiny GPT (tied embedding and head: on two stages under pp). A dp 2 ZeRO-1
run trains 3 steps, records every parameter, Adam moment and step count,
starts an async save and trains 2 more steps while it is written (which
must not change what is saved). tp 2·dp 2 and pp 2·dp 2 load that, train 2
steps, and save their own checkpoints. Then dp 4 (ZeRO 1, 2, 3) and dp 1
(ZeRO 0) load each of the three. A 4-layer ZB-V run (pp 2, its stages in a V)
saves one that dp 2 ZeRO-1 loads.

Every load must give back bit-equal tensors, the step and the data
position; the next 2 steps' losses must match those of the run that saved
(continuing uninterrupted) within the loss bounds of the equivalence tests
(another layout sums in another order; `tests/tolerances.py` derives them
from eager training of the plan in fp32 and fp64) — which they could not if
a sample were skipped or repeated.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ckpt_helpers import GLOBAL_BATCH, assert_restored, ckpt_plan, load_worker, save_worker
from dist_helpers import reference

from ptc.runtime.launcher import run_local
from tests.tolerances import assert_losses_match

pytestmark = pytest.mark.distributed
FAMILY = "gpt"
SAVED_STEPS, MORE = 3, 2


def plan(**layout):
    return ckpt_plan(family=FAMILY, **layout)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return {name: str(tmp_path_factory.mktemp(name)) for name in ("dp", "tp", "pp")}


@pytest.fixture(scope="module")
def expected(dirs):
    """What each checkpoint holds, and the losses of the steps after it (uninterrupted)."""
    saved = run_local(save_worker, 2, plan(dp=2, zero=1), dirs["dp"], SAVED_STEPS, MORE)[0]
    tp, pp = run_local(load_worker, 4, [(plan(tp=2, dp=2, zero=1), dirs["dp"]),
                                        (plan(pp=2, dp=2, zero=1), dirs["dp"])],
                       MORE, [dirs["tp"], dirs["pp"]])[0]
    return {"dp": (SAVED_STEPS, saved["state"], saved["after"], None),
            "tp": (SAVED_STEPS + MORE, tp["saved"], tp["saved_after"], tp),
            "pp": (SAVED_STEPS + MORE, pp["saved"], pp["saved_after"], pp)}


def check(got: dict, expected: tuple, what: str) -> None:
    step, state, after, _ = expected
    assert_restored(got, step, state, what)
    eager = plan(dp=1, zero=0)  # every step the checkpoints reach (the schedule's decay is fixed)
    eager = dataclasses.replace(eager, train=dataclasses.replace(
        eager.train, steps=SAVED_STEPS + 2 * MORE))
    assert_losses_match(got["after"], reference(eager), f"{what}: losses of the next steps",
                        steps=range(step, step + MORE), against=after)


@pytest.mark.timeout(300)
def test_tp_and_pp_layouts_load_a_dp_checkpoint(expected):
    for name in ("tp", "pp"):
        check(expected[name][3], expected["dp"], f"tp2·dp2 / pp2·dp2 ({name}) from dp2 ZeRO-1")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dp,jobs", [
    (4, [("dp", 2), ("dp", 3), ("tp", 3), ("pp", 1)]),
    (1, [("dp", 0), ("tp", 0), ("pp", 0)]),
], ids=["dp4", "dp1"])
def test_checkpoints_of_every_layout_reshard_to_dp(expected, dirs, dp, jobs):
    results = run_local(load_worker, dp, [(plan(dp=dp, zero=zero), dirs[source])
                                          for source, zero in jobs], MORE)[0]
    for (source, zero), got in zip(jobs, results):
        check(got, expected[source], f"dp{dp} ZeRO-{zero} from the {source} checkpoint")


@pytest.mark.timeout(300)
def test_a_zbv_checkpoint_reshards_to_dp(tmp_path):
    """ZB-V places a rank's two stages in a V (the tied GPT's embedding and head both on
    rank 0): its checkpoint (4 layers, pp 2) loads bit-equal under dp 2 ZeRO-1, at its step
    and data position, and the next 2 steps' losses are those the ZB-V run went on to."""
    def four_layers(**layout):
        base = plan(**{key: value for key, value in layout.items() if key != "schedule"})
        return dataclasses.replace(
            base, model=dataclasses.replace(base.model, layers=4),
            parallel=dataclasses.replace(base.parallel, schedule=layout.get("schedule", "1f1b")))

    zbv = four_layers(pp=2, dp=1, zero=0, schedule="zbv")
    saved = run_local(save_worker, 2, zbv, str(tmp_path), SAVED_STEPS, MORE)[0]
    got = run_local(load_worker, 2, [(four_layers(dp=2, zero=1), str(tmp_path))], MORE)[0][0]
    assert (got["step"], got["position"]) == (SAVED_STEPS, SAVED_STEPS * GLOBAL_BATCH)
    assert got["state"].keys() == saved["state"].keys()
    for name, value in saved["state"].items():
        assert torch.equal(got["state"][name], value), name
    eager = four_layers(dp=1, zero=0)
    eager = dataclasses.replace(eager, train=dataclasses.replace(
        eager.train, steps=SAVED_STEPS + MORE))
    assert_losses_match(got["after"], reference(eager), "dp2 ZeRO-1 from ZB-V",
                        steps=range(SAVED_STEPS, SAVED_STEPS + MORE), against=saved["after"])
