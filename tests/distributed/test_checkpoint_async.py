"""Async saves keep host memory flat; non-finite weights are never checkpointed.

One process each (a Checkpointer needs a process group). The memory test
uses a larger model (hidden 256, vocab 4096: 37.5 MiB of weights and Adam
state), so that keeping a snapshot per save would add 15 x 37.5 MiB from
save 5 to save 20. Measured growth is 2-11 MiB: allocator noise (DCP starts
a writer thread per save, and glibc gives threads their own arenas until
it reaches its arena limit). The bound is one snapshot in all.
"""

from __future__ import annotations

import dataclasses

import pytest
from ckpt_helpers import ckpt_plan, nonfinite_save_worker, rss_worker

from ptc.plan import ModelSpec
from ptc.runtime.checkpoint_store import CheckpointStore
from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(180)
def test_host_memory_does_not_grow_across_20_async_saves(tmp_path):
    plan = dataclasses.replace(ckpt_plan(dp=1, zero=0, steps=20, keep=2), model=ModelSpec(
        family="llama", layers=2, hidden=256, heads=4, kv_heads=2, ffn=512, vocab=4096,
        max_seq=16))
    got = run_local(rss_worker, 1, plan, str(tmp_path), 20)[0]
    growth = got["rss"][-1] - got["rss"][4]
    assert growth < got["state_bytes"], (
        f"RSS grew {growth / 2**20:.1f} MiB over 15 saves of "
        f"{got['state_bytes'] / 2**20:.1f} MiB: {[r >> 20 for r in got['rss']]}")
    assert CheckpointStore(tmp_path).visible() == [20, 19]  # keep = 2


@pytest.mark.timeout(120)
def test_nonfinite_weights_are_never_checkpointed(tmp_path):
    got = run_local(nonfinite_save_worker, 1, ckpt_plan(dp=1, zero=1), str(tmp_path))[0]
    assert got == {"first": True, "second": False}
    store = CheckpointStore(tmp_path)
    assert store.visible() == [1] and store.latest() == 1
    assert not store.partial_path(2).exists()
