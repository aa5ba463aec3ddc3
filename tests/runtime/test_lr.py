"""The learning-rate schedule: warm-up, then constant, cosine or linear decay."""

from __future__ import annotations

import math

import pytest
from runtime_helpers import tiny_plan  # noqa: F401 - puts the repo root on sys.path

from ptc.plan import LRScheduleSpec
from ptc.runtime.lr import learning_rate, schedule_change, schedule_record

pytestmark = pytest.mark.timeout(10)


def lrs(kind, steps=10, **kw):
    spec = LRScheduleSpec(kind=kind, **kw)
    return [learning_rate(t, 1.0, spec, steps) for t in range(steps)]


def test_warmup_rises_linearly_from_the_first_step():
    assert lrs("constant", warmup=4)[:5] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_constant():
    assert lrs("constant") == [1.0] * 10


def test_cosine_goes_from_peak_to_min_over_decay_steps():
    got = lrs("cosine", steps=10, warmup=2, min_lr=0.1)
    assert got[2] == 1.0
    assert got[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))
    assert got[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))


def test_linear_reaches_min_lr_at_decay_steps_and_stays():
    got = lrs("linear", steps=10, min_lr=0.2, decay_steps=5)
    assert got[:6] == pytest.approx([1.0, 0.84, 0.68, 0.52, 0.36, 0.2])
    assert got[9] == pytest.approx(0.2)


def test_a_resumed_run_hears_of_a_schedule_change_only_when_a_rate_changes():
    cosine = LRScheduleSpec(kind="cosine", warmup=2, min_lr=1e-4)
    constant = LRScheduleSpec(kind="constant", warmup=2)
    # more steps on a constant schedule: every rate from the resume on is the same
    assert schedule_change(schedule_record(1e-3, constant, 20),
                           schedule_record(1e-3, constant, 40), 20) is None
    # a cosine decaying over the run's steps: continuing to 40 steps raises step 21's rate
    line = schedule_change(schedule_record(1e-3, cosine, 20), schedule_record(1e-3, cosine, 40),
                           20)
    now = learning_rate(20, 1e-3, cosine, 40)
    assert line == (f"the learning-rate schedule differs from the checkpoint's (train.steps 20 "
                    f"-> 40): from step 21 the rate is {now:.3g} where the checkpoint's "
                    f"schedule gives 0.0001")
    # a fixed decay_steps: more steps change nothing
    fixed = LRScheduleSpec(kind="cosine", warmup=2, min_lr=1e-4, decay_steps=20)
    assert schedule_change(schedule_record(1e-3, fixed, 20), schedule_record(1e-3, fixed, 40),
                           20) is None
