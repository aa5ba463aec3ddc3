"""Python's garbage collector during training: collected at the same step on every rank.

`runtime.gc_every = N` turns the automatic collector off for the step loop and collects
after every N-th step (and once before the first), as torchtitan's `gc_freq` and
Megatron-LM's `--manual-gc` do, so that no rank pauses at a moment of its own; after the
loop the collector is as it was. `none` leaves the automatic collector alone.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
from runtime_helpers import tiny_plan

import ptc
from ptc.errors import PlanError
from ptc.runtime.loop import scheduled_collection

pytestmark = pytest.mark.timeout(60)


class _Recorder:
    """The gc module, with its collections counted and the collector's state recorded."""

    def __init__(self):
        self.collections = 0

    def collect(self, *args):
        self.collections += 1
        return gc.collect(*args)

    def __getattr__(self, name):
        return getattr(gc, name)


def test_collections_come_every_n_steps_with_the_automatic_collector_off(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr("ptc.runtime.loop.gc", recorder)
    with scheduled_collection(3) as collect:
        assert recorder.collections == 1 and not gc.isenabled()  # a clean heap to start
        for _ in range(7):
            collect()
        assert recorder.collections == 3  # after the 3rd and the 6th step
    assert gc.isenabled()
    with scheduled_collection(None) as collect:
        collect()
        assert gc.isenabled() and recorder.collections == 3


def test_a_run_collects_at_its_steps_and_gives_the_collector_back(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr("ptc.runtime.loop.gc", recorder)
    seen = []
    monkeypatch.setattr("ptc.runtime.loop.faults.at_step_start",
                        lambda rank, step: seen.append(gc.isenabled()))
    plan = tiny_plan("gpt", zero=0, dp=1, accum=1, steps=5)
    plan = dataclasses.replace(plan, runtime=dataclasses.replace(plan.runtime, gc_every=2))
    assert len(ptc.run(plan).losses) == 5
    assert seen == [False] * 5 and recorder.collections == 1 + 2  # the start, steps 2 and 4
    assert gc.isenabled()


def test_gc_every_takes_a_positive_step_count_or_none():
    plan = tiny_plan("gpt", zero=0, dp=1, accum=1)
    with pytest.raises(PlanError, match=r"gc_every must be >= 1, got 0"):
        dataclasses.replace(plan.runtime, gc_every=0)
    assert dataclasses.replace(plan.runtime, gc_every=None).gc_every is None
