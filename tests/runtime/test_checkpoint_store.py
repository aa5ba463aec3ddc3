"""The checkpoint directory (pointer, visibility, verify, keep-k, clean-up) and flat boxes.

No process group: the store is plain files, and `flat_boxes` plain index arithmetic.
"""

from __future__ import annotations

import math

import pytest
import torch
from runtime_helpers import ROOT  # noqa: F401 - puts the repo root on sys.path

from ptc.runtime.checkpoint_store import (
    MANIFEST,
    CheckpointError,
    CheckpointStore,
    Manifest,
    digest,
    step_name,
)
from ptc.runtime.dcp_chunks import FlatChunks, flat_boxes

pytestmark = pytest.mark.timeout(30)


def fake_save(store: CheckpointStore, step: int, payload: bytes = b"x" * 100,
              publish: bool = True) -> None:
    """Write a checkpoint as DCP would (files in the partial directory), then publish it."""
    partial = store.partial_path(step)
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(payload)
    (partial / ".metadata").write_bytes(b"index")
    if publish:
        files = {p.name: digest(p) for p in partial.iterdir()}
        store.publish(Manifest(step=step, position=8 * step, files=files, info={"dp": 2}))


def test_publish_moves_the_pointer_and_the_manifest_round_trips(tmp_path):
    store = CheckpointStore(tmp_path)
    assert store.latest() is None and store.visible() == []
    fake_save(store, 2)
    fake_save(store, 4)
    assert store.latest() == 4 and (tmp_path / "latest").read_text() == "step_00000004\n"
    assert store.visible() == [4, 2]
    manifest = store.manifest(4)
    assert (manifest.step, manifest.position, manifest.info) == (4, 32, {"dp": 2})
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert store.verify(4) == []


def test_partial_and_unpointed_checkpoints_are_invisible_and_cleaned(tmp_path):
    store = CheckpointStore(tmp_path)
    fake_save(store, 2)
    fake_save(store, 4, publish=False)  # a crash during the write
    fake_save(store, 6)
    (tmp_path / "latest").write_text(step_name(2) + "\n")  # a crash before the pointer moved
    assert store.visible() == [2]
    assert store.clean() == ["step_00000004.partial", "step_00000006"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002"]


def test_verify_finds_corruption_truncation_and_loss(tmp_path):
    store = CheckpointStore(tmp_path)
    fake_save(store, 2)
    data = store.path(2) / "__0_0.distcp"
    data.write_bytes(b"y" + b"x" * 99)
    assert store.verify(2) == ["__0_0.distcp fails its CRC-32 check"]
    data.write_bytes(b"x" * 60)
    assert store.verify(2) == ["__0_0.distcp has 60 bytes, 100 were written"]
    data.unlink()
    assert store.verify(2) == ["__0_0.distcp is missing"]
    (store.path(2) / MANIFEST).write_text("{not json")
    assert store.verify(2)[0].startswith("unreadable manifest")
    with pytest.raises(CheckpointError):
        store.manifest(2)


def test_damaged_checkpoints_are_set_aside_and_the_previous_stays_visible(tmp_path):
    store = CheckpointStore(tmp_path)
    fake_save(store, 2)
    fake_save(store, 4)
    store.mark_damaged(4)
    assert store.visible() == [2] and (tmp_path / "step_00000004.damaged").is_dir()
    assert store.clean() == []  # a damaged checkpoint is kept for inspection
    fake_save(store, 4)  # the resumed run saves step 4 again
    assert store.visible() == [4, 2]


def test_keep_k_counts_complete_checkpoints_only_and_keeps_the_latest(tmp_path):
    store = CheckpointStore(tmp_path)
    for step in (1, 2, 3, 4):
        fake_save(store, step)
    fake_save(store, 5, publish=False)
    assert store.prune(2) == [2, 1]
    assert store.visible() == [4, 3] and store.partial_path(5).is_dir()
    assert store.prune(0) == [3]  # keep >= 1: the latest is never deleted
    assert store.visible() == [4]


@pytest.mark.parametrize("shape", [(7, 5, 3), (4,), (3, 4), (2, 3, 2, 2)])
def test_flat_boxes_tile_any_range_in_order(shape):
    n = math.prod(shape)
    index = torch.arange(n).view(shape)
    for start in range(n + 1):
        for stop in range(start, n + 1):
            boxes = flat_boxes(shape, start, stop)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)
            covered = [index[tuple(slice(o, o + s) for o, s in zip(off, size))].flatten()
                       for off, size in boxes]
            got = torch.cat(covered) if covered else torch.empty(0, dtype=torch.long)
            assert torch.equal(got, torch.arange(start, stop)), (start, stop, boxes)


def test_flat_chunks_are_views_of_the_flat_range():
    flat = torch.arange(10.0)
    chunks = FlatChunks.from_flat((4, 5), flat, 3)  # elements 3..12 of a 4x5 tensor
    assert [tuple(t.shape) for t in chunks.pieces.values()] == [(1, 2), (1, 5), (1, 3)]
    assert list(chunks.pieces) == [(0, 3), (1, 0), (2, 0)]
    for piece in chunks.pieces.values():
        assert piece.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
