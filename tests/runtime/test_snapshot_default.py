"""`runtime.snapshot_every = auto`, the default: in-memory snapshots every step of a run that
checkpoints, where the node's tmpfs has room for them, and the run says which it chose.

A one-process run (world 1, in this process): the snapshot folder is a temporary one
(`PTC_SNAPSHOT_DIR`); what the room check finds is replaced to show the run without room.
"""

from __future__ import annotations

import dataclasses

import pytest
from runtime_helpers import tiny_plan

import ptc
from ptc.runtime.snapshot_room import snapshots_fit

pytestmark = pytest.mark.timeout(120)


def checkpointed(tmp_path, **runtime):
    plan = tiny_plan("gpt", zero=0, dp=1, accum=1, steps=3)
    return dataclasses.replace(plan, runtime=dataclasses.replace(
        plan.runtime, checkpoint_dir=str(tmp_path / "ckpt"), **runtime))


def test_snapshots_need_half_the_free_space_at_most():
    assert snapshots_fit(need=10, free=20) and not snapshots_fit(need=10, free=19)


def test_a_checkpointed_run_snapshots_every_step_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("PTC_SNAPSHOT_DIR", str(tmp_path / "shm"))
    held = []
    monkeypatch.setattr("ptc.runtime.loop.faults.at_step_start", lambda rank, step: held.append(
        sorted(p.name for p in (tmp_path / "shm").glob("*/*.safetensors"))))
    result = ptc.run(checkpointed(tmp_path))
    said = [e for e in result.events if e.startswith("in-memory snapshots")]
    assert len(said) == 1 and said[0].startswith(
        "in-memory snapshots every step (snapshot_every = auto): "), said
    assert held == [[], ["rank0.safetensors"], ["rank0.safetensors"]]  # before steps 1, 2, 3
    assert not list((tmp_path / "shm").glob("*/*"))  # the run ended well: removed


def test_without_room_the_run_says_so_and_keeps_no_snapshot(tmp_path, monkeypatch):
    monkeypatch.setenv("PTC_SNAPSHOT_DIR", str(tmp_path / "shm"))
    monkeypatch.setattr("ptc.runtime.loop.room_for_snapshots",
                        lambda trainer, folder: (3 << 30, 4 << 30))  # 3 GiB of 4 free
    held = []
    monkeypatch.setattr("ptc.runtime.loop.faults.at_step_start", lambda rank, step: held.append(
        list((tmp_path / "shm").glob("*/*.safetensors"))))
    result = ptc.run(checkpointed(tmp_path))
    assert ("in-memory snapshots off (snapshot_every = auto): 3.0 GiB for this node's ranks, "
            f"their own and a peer's, 4.0 GiB free in {tmp_path / 'shm'} on some node, and "
            "they may take half; restarts resume from storage") in result.events
    assert held == [[], [], []]


def test_snapshots_none_keeps_none_and_says_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PTC_SNAPSHOT_DIR", str(tmp_path / "shm"))
    result = ptc.run(checkpointed(tmp_path, snapshot_every=None))
    assert not [e for e in result.events if e.startswith("in-memory snapshots")]
    assert not (tmp_path / "shm").exists()
