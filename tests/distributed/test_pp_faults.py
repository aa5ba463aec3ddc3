"""The non-finite guard of the pipeline trainer, on CPU gloo: pp = 2, two processes.

A NaN is written into the last stage's gradient (`PTC_FAULT`, `ptc.runtime.faults`)
at one step; the guard (`health.guarded_update`, shared with the one-stage
trainer) must make both stages take the same action under each policy.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from ckpt_helpers import ckpt_plan, run_worker, with_runtime
from dist_helpers import ROOT

from ptc.runtime.checkpoint_store import CheckpointStore
from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed

BATCH = 4  # samples per step: 4 micro-batches of 1
STEPS = 4


@pytest.fixture(autouse=True)
def importable_ptc(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("PTC_TIMEOUT", "60")


def pp_fault_plan(tmp_path, policy: str):
    """Tiny GPT (2 layers, hidden 32), seq 8, pp = 2 on 2 processes, checkpointed every step."""
    base = ckpt_plan(dp=1, zero=0, pp=2, family="gpt", steps=STEPS, checkpoint_every=1, keep=1,
                     async_save=False)
    base = dataclasses.replace(base, train=dataclasses.replace(base.train, seq_len=8,
                                                               global_batch=BATCH))
    return with_runtime(base, nan_policy=policy, checkpoint_dir=str(tmp_path / policy))


def decisions(run: dict) -> list[str]:
    return [e for e in run["events"] if e.startswith("step ")]


@pytest.mark.timeout(120)
def test_pipeline_nonfinite_gradient_every_stage_takes_the_same_action(tmp_path):
    plans = [pp_fault_plan(tmp_path, policy) for policy in ("skip", "rollback")]
    # Rank 1 holds the last stage; its gradient gets a NaN in step 3.
    skip, rollback = zip(*run_local(run_worker, 2, plans, "nan:1:3").values())

    for run in (*skip, *rollback):
        assert run["error"] is None, run["error"]
    assert decisions(skip[0]) == decisions(skip[1])
    assert skip[0]["nonfinite"] == skip[1]["nonfinite"] == [(), (), (1,), ()]
    assert "step 3: non-finite loss or gradient on rank(s) [1]: step skipped, no update" \
        in skip[0]["events"]
    assert all(torch.isfinite(torch.tensor(skip[0]["losses"][3:])).tolist())

    assert decisions(rollback[0]) == decisions(rollback[1])
    bad = 2 * BATCH  # step 3's batch starts at sample 8
    assert (f"step 3: non-finite loss or gradient on rank(s) [1]: rolled back to step_00000002; "
            f"data resumes at sample {bad + BATCH} (samples {bad}..{bad + BATCH - 1} skipped)"
            ) in rollback[0]["events"]
    # steps 1, 2, 3 (bad), then 3 and 4 again on the data past the bad batch
    assert rollback[0]["nonfinite"] == rollback[1]["nonfinite"] == [(), (), (1,), (), ()]
    assert all(torch.isfinite(torch.tensor(rollback[0]["losses"][3:])).tolist())
    # The run saved after its last step: the save refuses non-finite weights on any rank.
    for policy in ("skip", "rollback"):
        store = CheckpointStore(tmp_path / policy)
        assert store.visible() == [STEPS] and store.verify(STEPS) == []
