"""Float8 delayed scaling resumes from a checkpoint as if never interrupted.

The tiny Llama in fp8 (emulated, delayed scaling over 16 steps), ZeRO-1 on
tp 2 × dp 2, trains 2N steps (N = 3) uninterrupted and checkpoints after N;
a second run restores that checkpoint and trains steps N+1..2N.

Tolerance: none. With the same layout the checkpoint gives back the
weights, Adam's moments and step, every rank's RNG state and every rank's
amax histories (`ptc.runtime.fp8_state`), so steps N+1..2N compute the same
float8 scales and then the same numbers: losses and every weight and moment
bit-equal. The control empties the histories after the restore: step N+1
then scales as current (each tensor by its own amax, not the largest of the
last N steps'), and its loss differs, which shows the test sees the history.

Resharding: the amaxes are maxed over tp, so a history is the same on
every tp rank and does not depend on tp; each dp rank's is its own (its
samples); a linear is named the same on whichever pipeline stage holds it.
Restored under tp 1 × dp 2, every rank gets exactly the history its dp rank
saved; under tp 2 × dp 1 (another dp: another split of the samples) every
rank gets the elementwise max of the two saved dp ranks'; under pp 2 × dp 1
each stage gets that max for its own linears, and the two stages' cover
every linear once.
"""

from __future__ import annotations

import pytest
import torch
from fp8_helpers import fp8_reshard_worker, fp8_resume_worker

from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed

N = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    directory = str(tmp_path_factory.mktemp("fp8_ckpt"))
    out = run_local(fp8_resume_worker, 4, directory, N)[0]
    # Each layout in a launch of its own: process groups re-created after
    # destroy_process_group in the same processes can time out in gloo's connect.
    out["resharded"] = {}
    for layout in ((1, 1, 2), (2, 1, 1), (1, 2, 1)):
        out["resharded"].update(run_local(fp8_reshard_worker, 2, [layout], directory)[0])
    return out


def by_dp(saved: list) -> dict[int, dict[str, torch.Tensor]]:
    """The saved histories by dp rank, checked equal over the tp ranks."""
    out: dict[int, dict] = {}
    for _, dp, histories in saved:
        if dp in out:
            for name, value in histories.items():
                assert torch.equal(out[dp][name], value), f"tp ranks differ: {name}"
        out.setdefault(dp, histories)
    return out


@pytest.mark.timeout(400)
def test_resumed_fp8_run_equals_the_uninterrupted_one(runs) -> None:
    whole, resumed = runs["uninterrupted"], runs["resumed"]
    assert resumed["losses"] == whole["losses"][N:]
    assert resumed["state"].keys() == whole["state"].keys()
    for name, value in whole["state"].items():
        assert torch.equal(resumed["state"][name], value), name
    saved = {(tp, dp): h for tp, dp, h in runs["saved"]}
    for tp, dp, histories in resumed["restored"]:
        assert histories.keys() == saved[tp, dp].keys() and histories
        for name, value in histories.items():
            assert torch.equal(value, saved[tp, dp][name]), name
    # N steps of history: the newest N columns hold amaxes, the rest is still empty.
    history = next(iter(saved[0, 0].values()))
    assert (history[:, :N] > 0).all() and (history[:, N:] == 0).all()


@pytest.mark.timeout(400)
def test_without_the_history_the_resumed_run_differs(runs) -> None:
    assert runs["fresh history"]["losses"][0] != runs["uninterrupted"]["losses"][N]


@pytest.mark.timeout(400)
def test_histories_reshard_across_tp_and_dp(runs) -> None:
    saved = by_dp(runs["saved"])
    for _, dp, histories in runs["resharded"][(1, 1, 2)]:  # same dp: each rank's own
        assert histories.keys() == saved[dp].keys()
        for name, value in histories.items():
            assert torch.equal(value, saved[dp][name]), name
    for layout in ((2, 1, 1), (1, 2, 1)):  # another dp: the max over the saved ranks
        seen = []
        for _, _, histories in runs["resharded"][layout]:
            seen += histories
            for name, value in histories.items():
                assert torch.equal(value, torch.maximum(saved[0][name], saved[1][name])), name
        assert sorted(set(seen)) == sorted(saved[0]), layout
    assert any(not torch.equal(saved[0][n], saved[1][n]) for n in saved[0])  # a real max
