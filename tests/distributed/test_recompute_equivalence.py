"""Activation checkpointing (policy full) on 2 gloo processes trains like plain PyTorch.

dp2 with ZeRO-1 and ZeRO-3, tiny GPT and Llama: losses of every step and the
parameters after training equal single-process AdamW on the eager model (the
reference of dist_helpers), with the tolerances of test_zero_equivalence.
"""

from __future__ import annotations

import pytest
from recompute_worker import run_checkpointed
from dist_helpers import assert_same_training, reference_run, tiny_plan

from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed

CASES = [("gpt", 1), ("llama", 1), ("llama", 3)]
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=1e-5, atol=1e-5)
_run: dict = {}


def _results() -> dict:
    if not _run:
        _run.update(run_local(run_checkpointed, 2, CASES, 2)[0])
    return _run


@pytest.mark.timeout(180)
@pytest.mark.parametrize("family,zero", CASES)
def test_full_checkpoint_matches_single_process_adamw(family: str, zero: int) -> None:
    got = _results()[(family, zero)]
    assert any(m.startswith("checkpoint_layers_pass: checkpointed 2 layers full")
               for m in got["log"])
    losses, state = reference_run(tiny_plan(family, zero=0, dp=2, accum=1))
    assert_same_training(got, losses, state, loss_tol=LOSS_TOL, param_tol=PARAM_TOL,
                         what=f"{family} zero={zero} dp=2 checkpoint=full")
