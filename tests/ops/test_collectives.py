"""ZeRO-3's gathered weights: freed after forward, re-gathered (prefetched) in backward."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import MODELS, tiny_plan

from ptc.lower.driver import compile_plan
from ptc.ops import zero3
from ptc.ops.collectives import GatherHandle
from ptc.compiler.records.overlap import IN_FLIGHT
from ptc.ops.comm import all_gather_flat, bind_axes, reduce_scatter_flat
from ptc.runtime.executor import Trainer

pytestmark = pytest.mark.timeout(60)


def forward_backward(prefetch: bool, monkeypatch, dtype: str = "fp32"):
    plan = tiny_plan("llama", zero=3, dp=1, accum=1, dtype=dtype, overlap=prefetch)
    trainer = Trainer(compile_plan(plan), {}, models=MODELS)
    tokens, targets = trainer.data.batch(0, 2)
    events: list[tuple[str, int]] = []
    start, regather = GatherHandle.start, zero3.ParamSession._regather

    def logged_start(handle):
        events.append(("start", id(handle)))
        start(handle)

    def logged_regather(session, handle):
        events.append(("need", id(handle)))
        return regather(session, handle)

    monkeypatch.setattr(GatherHandle, "start", logged_start)
    monkeypatch.setattr(zero3.ParamSession, "_regather", logged_regather)
    session = zero3.ParamSession(prefetch=prefetch, in_flight=IN_FLIGHT)
    with session, session.saved_tensor_hooks():
        loss = trainer.chunks[0].runner.run(tokens, targets)
    alive_after_forward = session.alive()
    forward_events = len(events)
    with session:
        loss.backward()
        session.finish()
    return trainer, session, alive_after_forward, events[forward_events:]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gathered_weights_do_not_outlive_forward(monkeypatch, dtype):
    trainer, session, alive, _ = forward_backward(True, monkeypatch, dtype)
    assert alive == 0
    assert all(u.master.grad.abs().sum() > 0 for u in trainer.units)  # backward reached them


def test_backward_regathers_each_gather_once_and_prefetches_the_next(monkeypatch):
    _, session, _, events = forward_backward(True, monkeypatch)
    needed = [h for kind, h in events if kind == "need"]
    regathered = list(dict.fromkeys(needed))  # first need of each gather, backward order
    saved = [id(h) for h in session._saved]
    assert regathered == saved[::-1]  # the layers whose weights autograd saved, last first
    assert sum(kind == "start" for kind, _ in events) == len(saved)
    for h in regathered[1:]:  # all but the first were started before they were needed
        assert events.index(("start", h)) < events.index(("need", h))


def test_without_prefetch_backward_gathers_on_demand(monkeypatch):
    _, _, _, events = forward_backward(False, monkeypatch)
    for i, (kind, h) in enumerate(events):
        if kind == "start":
            assert events[i - 1] == ("need", h)


def test_single_rank_collectives_are_local():
    x = torch.arange(6.0)
    with bind_axes({}):
        assert all_gather_flat(x, None).wait() is x
        assert reduce_scatter_flat(x, None).wait() is x
        out = torch.empty(6)
        assert torch.equal(all_gather_flat(x, None, out=out).wait(), x)
