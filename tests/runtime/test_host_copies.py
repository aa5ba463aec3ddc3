"""Copy lanes on a CPU device run a copy when its landing is first waited for, and
ZeRO-3's Arrivals wait for a shard's copy at its first gather only."""

from __future__ import annotations

import torch

from ptc.ops.zero3 import Arrivals
from ptc.runtime.host_copies import Lane


def test_a_cpu_copy_lands_when_first_waited_for() -> None:
    lane = Lane(torch.device("cpu"))
    dst, src = torch.zeros(4), torch.arange(4.0)
    landing = lane.copy(dst, src)
    assert torch.equal(dst, torch.zeros(4))  # not yet: a reader that does not wait sees this
    src += 10  # ...and what the source holds when the wait comes is what lands
    landing.wait_device()
    assert torch.equal(dst, torch.arange(4.0) + 10)
    src += 10
    landing.wait_host()  # once only
    assert torch.equal(dst, torch.arange(4.0) + 10)


def test_a_copy_after_another_lands_it_first() -> None:
    up, down = Lane(torch.device("cpu")), Lane(torch.device("cpu"))
    host, device = torch.ones(3), torch.zeros(3)
    sent = up.copy(device, host)
    down.copy(host, torch.full((3,), 7.0), after=sent)  # overwrites what `sent` reads
    assert torch.equal(device, torch.ones(3))


def test_arrivals_wait_at_a_shards_first_gather() -> None:
    arrivals, waited = Arrivals(), []
    shards = [torch.zeros(2), torch.zeros(2)]
    for index, shard in enumerate(shards):
        arrivals.expect(shard, lambda index=index: waited.append(index))
    arrivals.before_gather(shards[1:])
    arrivals.before_gather(shards)  # the second shard's copy is already waited for
    assert waited == [1, 0]
    arrivals.expect(shards[0], lambda: waited.append("again"))
    arrivals.clear()
    arrivals.before_gather(shards)
    assert waited == [1, 0]
