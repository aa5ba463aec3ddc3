"""The optimizer over this rank's fp32 master weights, with clipping across shards.

At ZeRO-0 every rank updates the full masters; from ZeRO-1 on each rank
updates only its shard of every unit, so optimizer state is 1/dp per rank.
The update itself is `torch.optim.AdamW` (or SGD) run on the flat master
buffers: AdamW is elementwise, so updating a flat shard gives the same
numbers as updating the full model's parameters one by one.

Parameters the model does not train (requires_grad = False) keep their
values: their gradients are zero (autograd computes none below ZeRO-3; the
trainer zeroes ZeRO-3's, `params.drop_grads`), so the norm counts only the
trained parameters, as `clip_grad_norm_` over those
with a gradient does, and their elements of each master (`frozen` ranges)
are restored after each update (AdamW's weight decay would shrink them), as
eager PyTorch leaves a parameter without a gradient alone.

Global-norm clipping follows `torch.nn.utils.clip_grad_norm_`: the norm of
all gradients, then every gradient times min(1, max_norm / (norm + 1e-6)).
Each rank gives its part of the squared norm (`norm_share`): summed over
every rank of the job — by the non-finite guard's one all-reduce, which
carries it (`ptc.runtime.health.guarded_update`) — the parts count each
gradient element once, so the norm costs no collective of its own.

With optimizer offload (`ptc.runtime.offload`) the masters and their
gradients are host tensors: the norm is taken of the same fp32 gradients
where the reductions left them, on the device (`norm_share(grads=...)`),
while they travel to the host, and each unit is stepped on its own as soon
as its gradient has arrived (`step(lr, unit=i)`). AdamW and SGD are
elementwise, with a step count per tensor, so stepping the units one by one
gives the numbers of one step over all of them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
import torch.distributed as dist

from ptc.plan import OptimizerSpec
from ptc.ops.comm import group_rank, group_size
from ptc.runtime.params import UnitState

CLIP_EPS = 1e-6
"""torch.nn.utils.clip_grad_norm_'s epsilon."""


class ShardedOptimizer:
    """AdamW / SGD on the rank's masters, learning rate set per step, clipping over dp."""

    def __init__(self, units: list[UnitState], spec: OptimizerSpec,
                 group: dist.ProcessGroup | None, *, sharded: bool,
                 tp_group: dist.ProcessGroup | None = None,
                 ep_group: dist.ProcessGroup | None = None,
                 replicated: list[list[tuple[int, int]]] | None = None,
                 frozen: list[list[tuple[int, int]]] | None = None):
        self.units, self.group, self.sharded = units, group, sharded
        self.tp_group, self.ep_group = tp_group, ep_group
        self.replicated = replicated or [[] for _ in units]
        """Per unit, master element ranges of parameters replicated over tp (ptc.runtime.tp_state)."""
        self.frozen = frozen or [[] for _ in units]
        """Per unit, master element ranges of parameters the model does not train."""
        self.spec = spec
        self.inner = self._optimizer([u.master for u in units])
        """The optimizer of every master; its `state` is the one state of all (checkpoints)."""
        self._single: dict[int, torch.optim.Optimizer] = {}

    def _optimizer(self, masters: list[torch.Tensor]) -> torch.optim.Optimizer:
        spec = self.spec
        if spec.name == "adamw":
            return torch.optim.AdamW(masters, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                     weight_decay=spec.weight_decay)
        return torch.optim.SGD(masters, lr=spec.lr, momentum=spec.momentum,
                               weight_decay=spec.weight_decay)

    def norm_share(self, *, uncounted: Collection[int] = (),
                   grads: Sequence[torch.Tensor] | None = None, whole: bool = False
                   ) -> torch.Tensor:
        """This rank's part of the squared global L2 norm of the gradient: summed over every
        rank of the job, the square of the norm `clip_grad_norm_` takes.

        Sums the squares of this rank's gradients (`grads[i]` of unit i, default each
        master's `.grad`), leaving out the units whose ids are in `uncounted` (the extra
        copies of a weight tied across pipeline stages), and counts each element once over
        the ranks that hold it: a parameter tp replicates 1/tp on each tp rank; below ZeRO-1,
        where every rank of dp·cp holds the whole reduced gradient, on the first rank of
        dp·cp, the routed experts' on the first ep ranks (each holding other experts); from
        ZeRO-1 on each rank its own shard. The ranks of different tp and pp places hold
        different parameters. `whole`: every gradient this rank holds counts (pure data
        parallelism at ZeRO-0, whose guard takes no sum: `ptc.runtime.health.FoldedGuard`).
        """
        grads = [u.master.grad for u in self.units] if grads is None else list(grads)
        counted = [(u, g, ranges) for u, g, ranges in zip(self.units, grads, self.replicated)
                   if id(u) not in uncounted]
        device = self.units[0].grad.device if self.units else None  # where the guard runs
        tp = group_size(self.tp_group)
        place = group_rank(self.group)  # where this rank is in dp·cp

        def holds_once(unit: UnitState) -> bool:
            if self.sharded or whole:
                return True
            return place < group_size(self.ep_group) if unit.spec.expert else place == 0

        squares = torch.zeros((), device=device)
        for unit, g, ranges in counted:
            if not holds_once(unit):
                continue
            part = g.pow(2).sum()
            if tp > 1:  # every tp rank holds the same gradient of a replicated parameter
                same = sum((g[a:b].pow(2).sum() for a, b in ranges),
                           torch.zeros((), device=g.device))
                part = part - same * (1 - 1 / tp)
            squares = squares + part.to(device)
        return squares

    def clip_factor(self, max_norm: float | None, squared_norm: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(global norm, factor min(1, max_norm / (norm + eps)) or None without `max_norm`),
        from the job's sum of `norm_share`."""
        norm = squared_norm.sqrt()
        if max_norm is None:
            return norm, None
        return norm, (max_norm / (norm + CLIP_EPS)).clamp(max=1.0)

    def clip(self, max_norm: float | None, squared_norm: torch.Tensor) -> float:
        """Scale gradients so their global norm is at most `max_norm`; return the norm before.

        `squared_norm`: the job's sum of `norm_share`; every unit is scaled.
        """
        norm, scale = self.clip_factor(max_norm, squared_norm)
        if scale is not None:
            for unit in self.units:
                unit.master.grad.mul_(scale.to(unit.master.device))
        return float(norm)

    def step(self, lr: float, unit: int | None = None) -> None:
        """One update at learning rate `lr` of every master, or of unit `unit`'s alone; the
        elements of parameters the model does not train keep their values."""
        optimizer = self.inner if unit is None else self._one(unit)
        for group in optimizer.param_groups:
            group["lr"] = lr
        stepped = range(len(self.units)) if unit is None else (unit,)
        kept = [(self.units[i].master[a:b], self.units[i].master[a:b].clone())
                for i in stepped for a, b in self.frozen[i]]
        optimizer.step()
        with torch.no_grad():
            for view, value in kept:
                view.copy_(value)

    def _one(self, index: int) -> torch.optim.Optimizer:
        """An optimizer of unit `index`'s master alone, sharing the state of `inner`."""
        if index not in self._single:
            one = self._single[index] = self._optimizer([self.units[index].master])
            one.state = self.inner.state
        return self._single[index]

    def zero_grad(self) -> None:
        """Zero the gradient accumulators (kept allocated: they are reused every step)."""
        for unit in self.units:
            unit.grad.zero_()

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the optimizer state (moments and step counters)."""
        return [t for state in self.inner.state.values() for t in state.values()
                if isinstance(t, torch.Tensor)]
