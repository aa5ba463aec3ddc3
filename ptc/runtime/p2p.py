"""Asynchronous point-to-point transfers of boundary values between pipeline ranks.

One message per tensor, in boundary order. Between two ranks, messages are
matched in the order they are posted (what NCCL requires and gloo does for
one tag); the schedule's lowering posts every receive in the order its peer
sends (`ptc.compiler.schedule.lowering.per_rank_actions`), so no tags are needed. Peers are
named by their index in the pipeline group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ptc.compiler.records.stages import Boundary


class Transfer:
    """Messages in flight: `wait()` returns the tensors once every message is done."""

    __slots__ = ("_works", "tensors")

    def __init__(self, works: list, tensors: list[torch.Tensor]):
        self._works = works
        self.tensors = tensors  # a send's tensors must stay alive until it completes

    def done(self) -> bool:
        """Whether every message has completed (never blocks)."""
        return all(w.is_completed() for w in self._works)

    def wait(self) -> list[torch.Tensor]:
        """Block until every message is done; return the tensors."""
        for work in self._works:
            work.wait()
        self._works = []
        return self.tensors


def post_recv(specs: Sequence[Boundary], peer: int, group: dist.ProcessGroup,
              device: torch.device, *, grads: bool = False) -> Transfer:
    """Post receives of `specs`' values (or, with `grads`, of their gradients) from `peer`."""
    specs = [b for b in specs if b.requires_grad] if grads else list(specs)
    buffers = [torch.empty(b.shape, dtype=b.dtype, device=device) for b in specs]
    works = [dist.irecv(t, group=group, group_src=peer) for t in buffers]
    return Transfer(works, buffers)


def send(tensors: Sequence[torch.Tensor], peer: int, group: dist.ProcessGroup) -> Transfer:
    """Post sends of `tensors` to `peer` (each made contiguous, detached from autograd)."""
    payload = [t.detach().contiguous() for t in tensors]
    return Transfer([dist.isend(t, group=group, group_dst=peer) for t in payload], payload)
