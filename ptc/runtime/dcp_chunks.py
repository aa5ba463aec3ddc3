"""Parameters saved by full name from flat shards: arbitrary chunks for DCP.

A rank's ZeRO shard of a unit is a range of the unit's flat buffer, so it
holds a contiguous *flat range* of each parameter it touches — in general
not a rectangle of the parameter. `flat_boxes` cuts a flat range of a
row-major tensor into the few rectangles (at most 2·ndim - 1) it is made
of; each is a contiguous slice of the range. A `FlatChunks` is one tensor of
full (unsharded) shape of which this rank holds such boxes, views into its
own buffers.

DCP then stores every parameter under its full name and global shape, as
chunks with offsets: a checkpoint written under one layout is read under
any other, DCP reading for each box the parts of the saved chunks that
overlap it. `FlatChunks` implements DCP's checkpointable protocol
(`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`);
DCP's default planners look objects up only for tensors, so `SavePlanner`
and `LoadPlanner` extend that lookup to `FlatChunks`. ShardedTensor would
do the same job but is deprecated in favour of DTensor, whose shards must
follow `torch.chunk` and cannot express these ranges.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, sizes) of a rectangle of a tensor."""


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The rectangles that make up elements [start, stop) of a row-major tensor of `shape`.

    In increasing flat order, so that box i is the i-th contiguous slice of the range.
    """
    shape = tuple(shape)
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, end = start // inner, -(-stop // inner)  # rows touched: [first, end)
    if end - first == 1:  # one row: recurse inside it
        return [((first, *o), (1, *s)) for o, s in
                flat_boxes(shape[1:], start - first * inner, stop - first * inner)]
    boxes = []
    if start % inner:  # a partial first row
        boxes += [((first, *o), (1, *s)) for o, s in flat_boxes(shape[1:], start % inner, inner)]
        first += 1
    whole_end = stop // inner
    if whole_end > first:  # whole rows
        boxes.append(((first,) + (0,) * (len(shape) - 1), (whole_end - first, *shape[1:])))
    if stop % inner:  # a partial last row
        boxes += [((whole_end, *o), (1, *s)) for o, s in flat_boxes(shape[1:], 0, stop % inner)]
    return boxes


class FlatChunks:
    """A tensor of full `shape` of which this rank holds some boxes (views into its buffers)."""

    def __init__(self, shape: Sequence[int], pieces: Sequence[tuple[Sequence[int], torch.Tensor]]):
        self.shape = torch.Size(shape)
        self.pieces = {tuple(offsets): tensor for offsets, tensor in pieces}

    @classmethod
    def from_flat(cls, shape: Sequence[int], flat: torch.Tensor, start: int) -> FlatChunks:
        """The chunks of a `shape` tensor whose elements [start, start + len(flat)) are `flat`."""
        pieces, used = [], 0
        for offsets, sizes in flat_boxes(shape, start, start + flat.numel()):
            n = math.prod(sizes)
            pieces.append((offsets, flat[used:used + n].view(sizes)))
            used += n
        return cls(shape, pieces)

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                         sizes=tensor.size()),
                              properties=TensorProperties.create_from_tensor(tensor),
                              size=self.shape))
                for offsets, tensor in self.pieces.items()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.size())
                for offsets, tensor in self.pieces.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[tuple(index.offset)]


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, finding the data of `FlatChunks` items too."""

    def lookup_object(self, index: MetadataIndex):
        value = self.state_dict[index.fqn]
        if isinstance(value, FlatChunks):
            return value.__get_tensor_shard__(index)
        return super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading into the boxes of `FlatChunks` items too."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # The default set-up replaces objects it does not know by None (torch 2.13's
        # _init_state_dict), so FlatChunks join the state dict after it.
        chunks = {k: v for k, v in state_dict.items() if isinstance(v, FlatChunks)}
        rest = {k: v for k, v in state_dict.items() if k not in chunks}
        super().set_up_planner(rest, metadata, is_coordinator)
        self.state_dict.update(chunks)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict[index.fqn]
        if isinstance(value, FlatChunks):
            return value.__get_tensor_shard__(index)
        return super().lookup_tensor(index)
