"""Single-process pieces of run health: the non-finite check, timeouts, fault hooks, elastic plans."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from runtime_helpers import tiny_plan

from ptc.errors import PtcError
from ptc.runtime import faults
from ptc.runtime.elastic import is_elastic_range, plan_for_world
from ptc.runtime.health import FoldedGuard, is_timeout, nonfinite_ranks

pytestmark = pytest.mark.timeout(30)


def test_nonfinite_check_without_a_process_group():
    assert nonfinite_ranks([torch.ones(3), torch.zeros(2)]) == ()
    assert nonfinite_ranks([torch.ones(3), torch.tensor([1.0, float("nan")])]) == (0,)
    assert nonfinite_ranks([torch.tensor([float("inf"), 1.0])]) == (0,)


def _folded_step(loss: float, grads: list[torch.Tensor], *, others: list[float],
                 others_bad: tuple[int, ...] = (), summed: list[torch.Tensor] | None = None):
    """One step of rank 0's FoldedGuard in a job of 1 + len(others) ranks, the all-reduce
    played by hand: the other ranks' flags (`others_bad`) and losses added into the slots,
    `summed` the reduced gradients (default: rank 0's own)."""
    guard = FoldedGuard(0, 1 + len(others), torch.device("cpu"))
    total = torch.zeros(())
    guard.start(0, total, grads)
    total += loss  # the step sums its losses into the tensor `start` was given, in place
    guard.see(grads)
    slots = guard.slots()
    world = guard.world
    for rank, theirs in enumerate(others, start=1):
        slots[rank] += float(rank in others_bad)
        slots[world + rank] += theirs
    return guard.verdict(grads if summed is None else summed)


def test_folded_guard_names_the_ranks_and_sums_the_loss_without_a_collective():
    finite = [torch.ones(3), torch.zeros(2)]
    bad, total = _folded_step(2.0, finite, others=[3.0, 4.0])
    assert bad == () and float(total) == 9.0
    # A non-finite loss with finite gradients is caught, and names the rank it was on.
    bad, total = _folded_step(float("inf"), finite, others=[3.0])
    assert bad == (0,) and not torch.isfinite(total)
    nan = [torch.tensor([1.0, float("nan")])]
    assert _folded_step(2.0, nan, others=[3.0])[0] == (0,)
    # Another rank's flag arrives through the all-reduce; its NaN is in the sum too.
    assert _folded_step(2.0, finite, others=[3.0, 4.0], others_bad=(2,), summed=nan)[0] == (2,)
    # Only the sum is non-finite (finite parts that overflow): every rank sees it.
    inf = [torch.tensor([float("inf")])]
    assert _folded_step(2.0, finite, others=[3.0, 4.0], summed=inf)[0] == (0, 1, 2)


def test_folded_guard_wants_its_slots_carried(monkeypatch):
    guard = FoldedGuard(0, 2, torch.device("cpu"))
    guard.start(0, torch.zeros(()), [torch.zeros(2)])
    with pytest.raises(RuntimeError, match="did not carry the guard's slots"):
        guard.verdict([torch.zeros(2)])
    # The nan fault hook fires at the start, into the rank's own gradient, before its
    # reduction: its own flag catches it.
    monkeypatch.setenv(faults.ENV, "nan:1:3")
    faults._fired.clear()
    guard, grads = FoldedGuard(1, 2, torch.device("cpu")), [torch.zeros(4)]
    guard.start(2, torch.zeros(()), grads)
    assert torch.isnan(grads[0][0])
    guard.see(grads)
    assert guard.slots()[:2].tolist() == [0.0, 1.0]
    assert guard.verdict(grads)[0] == (1,)


def test_timeouts_are_recognised_through_the_cause_chain():
    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms "
                        "for recv operation to complete")
    wrapped = PtcError("rank 0: RuntimeError: ... during backward")
    wrapped.__cause__ = gloo
    assert is_timeout(wrapped) and not is_timeout(RuntimeError("index out of range"))


def test_fault_hook_fires_once_for_its_rank_and_step(monkeypatch):
    monkeypatch.setenv(faults.ENV, "nan:1:3")
    faults._fired.clear()
    grads = [torch.zeros(4)]
    faults.corrupt_gradients(0, 3, grads)
    faults.corrupt_gradients(1, 2, grads)
    assert torch.isfinite(grads[0]).all()
    faults.corrupt_gradients(1, 3, grads)
    assert torch.isnan(grads[0][0])
    grads[0].zero_()
    faults.corrupt_gradients(1, 3, grads)  # once per process: a rolled-back run goes through
    assert torch.isfinite(grads[0]).all()
    monkeypatch.setenv(faults.ENV, "melt:1:3")
    with pytest.raises(ValueError, match="unknown fault 'melt'"):
        faults.at_step_start(1, 3)
    monkeypatch.setenv(faults.ENV, "kill@melt:1:3")
    with pytest.raises(ValueError, match="unknown fault 'kill@melt'.*kill@PHASE"):
        faults.at_step_start(1, 3)


def test_a_kill_fires_in_its_phase_and_its_attempt_only(monkeypatch):
    """`kill@PHASE:RANK:STEP:ATTEMPT`: in the launcher's restart ATTEMPT (0 by default)."""
    killed = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: killed.append(sig))
    monkeypatch.setenv(faults.ENV, "kill@backward:1:3:2,kill:0:5")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    for phase, rank, step in [("forward", 1, 3), ("backward", 0, 3), ("backward", 1, 4),
                              ("start", 0, 5)]:
        faults.at_phase(phase, rank, step)
    assert not killed
    faults.at_phase("backward", 1, 3)
    assert killed == [faults.signal.SIGKILL]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    faults.at_step_start(0, 5)
    assert len(killed) == 2


def test_elastic_plan_keeps_the_global_batch_on_the_processes_that_joined():
    plan = tiny_plan("gpt", zero=1, dp=4, accum=2)  # global batch 8, micro-batch 1
    smaller = plan_for_world(plan, 2)
    assert (smaller.parallel.dp, smaller.num_microbatches) == (2, 4)
    assert smaller.train == plan.train and smaller.hardware.num_gpus == 2
    assert plan_for_world(plan, 4) is plan
    with pytest.raises(PtcError, match="global_batch\\(8\\) is not divisible"):
        plan_for_world(plan, 16)
    tp2 = dataclasses.replace(plan, parallel=dataclasses.replace(plan.parallel, tp=2, dp=2))
    with pytest.raises(PtcError, match="not a multiple of tp\\(2\\)"):
        plan_for_world(tp2, 3)
    ep4 = dataclasses.replace(plan, parallel=dataclasses.replace(plan.parallel, ep=4))
    assert plan_for_world(ep4, 8).parallel.ep == 4
    with pytest.raises(PtcError, match="ep\\(4\\) does not divide dp\\(2\\)"):
        plan_for_world(ep4, 2)  # expert shards fold from dp: ep must still divide it
    assert is_elastic_range("1:2") and not is_elastic_range("2") and not is_elastic_range("2:2")
