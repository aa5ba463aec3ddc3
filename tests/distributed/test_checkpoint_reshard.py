"""A checkpoint saved under one layout loads under another: dp 2 ZeRO-1 -> dp 4 ZeRO-2/3, dp 1.

The dp 2 run trains 3 steps, records every parameter and optimizer tensor,
starts an async save and trains 2 more steps while it is written (which
must not change what is saved). Each other layout restores it: every
parameter, Adam moment and step count is bit-equal to the recorded one,
the data position (sample 24) and step come back, and the next 2 steps'
losses equal the uninterrupted dp 2 run's within the tolerances of
test_zero_equivalence (rtol 1e-5, atol 1e-6: another dp sums the loss in
another order), which they could not if a sample were skipped or repeated.
"""

from __future__ import annotations

import pytest
import torch
from ckpt_helpers import GLOBAL_BATCH, ckpt_plan, load_worker, save_worker

from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed
SAVED_STEPS, MORE = 3, 2
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ckpt"))
    return directory, run_local(save_worker, 2, ckpt_plan(dp=2, zero=1), directory,
                                SAVED_STEPS, MORE)[0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dp,zeros", [(4, (2, 3)), (1, (0,))], ids=["dp4-zero2-zero3", "dp1-zero0"])
def test_checkpoint_reshards_on_load_and_training_continues(saved, dp, zeros):
    directory, reference = saved
    results = run_local(load_worker, dp, [ckpt_plan(dp=dp, zero=z) for z in zeros],
                        directory, MORE)[0]
    for zero, got in zip(zeros, results):
        what = f"dp {dp} ZeRO-{zero}"
        assert (got["step"], got["position"]) == (SAVED_STEPS, SAVED_STEPS * GLOBAL_BATCH), what
        assert got["state"].keys() == reference["state"].keys(), what
        for name, expected in reference["state"].items():
            assert torch.equal(got["state"][name], expected), f"{what}: {name} differs"
        torch.testing.assert_close(torch.tensor(got["after"]), torch.tensor(reference["after"]),
                                   **LOSS_TOL, msg=lambda m, w=what: f"{w}: losses\n{m}")
