"""Expert-parallel ops: send mixture-of-experts tokens to the ranks that own their experts.

Terms. A MoE block computes `grouped_mm(x, W, offs)`: x holds N token rows
sorted by expert, W stacks the weights of E experts, and offs[i] is the end
row of expert i's group (so offs[-1] = N). The *ep group* is the ranks of
the expert-parallel mesh axis ("ep"); with ep ranks, rank j owns the *local
experts* [j·El, (j+1)·El), El = E / ep, and holds only their slice of W.
The *route* is the [ep, E] int64 matrix of every ep rank's rows per expert
(row s: what rank s routes to each expert); it fixes every split and
permutation below, so each op recomputes them from it alone.

Orders. The rows a rank receives arrive *source-major*: source rank 0's
rows (for local expert 0, then 1, ...), then source 1's, and so on.
Grouped matmul wants them *expert-major*: local expert 0's rows (from
source 0, then source 1, ...), then local expert 1's. Within one (source,
expert) block rows keep the sender's order. Because x is sorted by expert
and rank j's experts are contiguous, x is already the send buffer, and what
comes back is in x's order.

| op           | forward                                           | backward                         |
|--------------|---------------------------------------------------|----------------------------------|
| `ep_dispatch`| all-gather of the counts (the route), all-to-all  | un-regroup, reverse all-to-all   |
|              | of x (and each extra row tensor), regroup         | (no gradient for offs, route)    |
|              | expert-major                                      |                                  |
| `ep_combine` | un-regroup source-major, reverse all-to-all back  | regroup: the dispatch all-to-all |
|              | to x's order                                      | of the gradient                  |

Ops name a mesh axis ("ep"), never a process group: `ptc.ops.comm` binds
axes to groups at run time. An unbound axis, or a group of one rank, makes
both ops local (dispatch returns its inputs, combine is the identity), so a
lowered graph also runs in one plain process. A `ShapeGroup(n)` gives meta
outputs of the shape balanced routing would give and moves nothing. Each
exchange is logged by `ptc.ops.comm.note` ("all_gather" for the counts,
"all_to_all" for rows), and each op carries `ptc_collective` for
`ptc.views.inspect`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ptc.ops.comm import Group, ShapeGroup, Work, all_gather_flat, axis_group, group_rank, \
    group_size, note
from ptc.ops.session import Session
from ptc.ops.tp_ops import _collective

EP = "ep"
"""The mesh axis of expert parallelism."""


def expert_counts(offs: torch.Tensor) -> torch.Tensor:
    """Rows per expert (int64) from the cumulative row ends `offs`."""
    ends = offs.round() if offs.is_floating_point() else offs
    ends = ends.to(torch.int64)
    return torch.diff(ends, prepend=ends.new_zeros(1))


class _Plan:
    """Splits and permutations of this rank's exchange, derived from the route alone.

    `send[j]`: rows this rank sends to rank j; `recv[s]`: rows it receives
    from rank s; `order`: for each expert-major position, its row in the
    source-major received buffer (`received[order]` regroups);
    `inverse`: the reverse permutation; `per_expert`: received rows per
    local expert.
    """

    __slots__ = ("send", "recv", "order", "inverse", "per_expert")

    def __init__(self, route: torch.Tensor, group: Group):
        ep, experts = route.shape
        rank = group_rank(group)
        if ep != group_size(group):
            raise ValueError(f"expert parallel: the route is for {ep} ranks, the group has "
                             f"{group_size(group)}")
        blocks = route.view(ep, ep, experts // ep)  # [source, owner, local expert]
        self.send = blocks[rank].sum(1).tolist()
        mine = blocks[:, rank]  # [source, local expert]: rows this rank receives
        self.recv = mine.sum(1).tolist()
        self.per_expert = mine.sum(0)
        sizes = mine.reshape(-1)  # source-major block sizes
        starts = torch.cumsum(sizes, 0) - sizes  # block starts in the received buffer
        sizes_em, starts_em = mine.t().reshape(-1), starts.view_as(mine).t().reshape(-1)
        total = int(sizes.sum())
        first = torch.cumsum(sizes_em, 0) - sizes_em  # block starts in expert-major order
        shift = torch.repeat_interleave(starts_em - first, sizes_em, output_size=total)
        self.order = torch.arange(total, device=route.device) + shift
        self.inverse = torch.empty_like(self.order)
        self.inverse[self.order] = torch.arange(total, device=route.device)


def _exchange(t: torch.Tensor, send: list[int], recv: list[int], group: Group) -> torch.Tensor:
    """All-to-all of t's rows: `send[j]` rows to rank j, `recv[s]` rows from rank s."""
    t = t.contiguous()
    out = t.new_empty((sum(recv), *t.shape[1:]))
    note("all_to_all", group, t)
    work = dist.all_to_all_single(out, t, output_split_sizes=recv, input_split_sizes=send,
                                  group=group, async_op=True)
    return Work(work, out, t).wait()  # waited through Work: counted as exposed


def _meta(t: torch.Tensor) -> torch.Tensor:
    """A ShapeGroup's result for rows t: as many rows (balanced routing), nothing moved."""
    return t.new_empty(t.shape)


def _move(t: torch.Tensor, plan: _Plan | None, group: Group, to_experts: bool) -> torch.Tensor:
    """Rows in this rank's x order to its local experts' rows, expert-major (`to_experts`),
    or back; `plan` None: a ShapeGroup's shapes, nothing moved."""
    if plan is None:
        return _meta(t)
    if to_experts:
        return _exchange(t, plan.send, plan.recv, group)[plan.order]
    return _exchange(t[plan.inverse], plan.recv, plan.send, group)


class _Move(torch.autograd.Function):
    """`_move` forward; the other way backward, by the same plan (computed once a layer)."""

    @staticmethod
    def forward(ctx, t, plan, group, to_experts):  # noqa: D102 - autograd.Function protocol
        ctx.plan, ctx.group, ctx.to_experts = plan, group, to_experts
        return _move(t, plan, group, to_experts)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return _move(grad, ctx.plan, ctx.group, not ctx.to_experts), None, None, None


class RoutedTokens(Session):
    """Entered while forwards run (not their recompute): the rows each dispatch routed to
    each expert, every rank of its ep group's, and the rows dropped over capacity — what
    the run's metrics report."""

    def __init__(self) -> None:
        self.counts: list[torch.Tensor] = []
        """Per dispatch, in call order: rows per expert [E], summed over the ep group."""
        self.ranks: list[int] = []
        """Per dispatch: the ep ranks its experts were shared out over."""
        self.dropped: int | None = None
        """Rows dropped over the experts' capacity (`ptc.ops.expert_capacity`), this rank's;
        None where no capacity applies."""

    def drop(self, rows: int) -> None:
        """Count `rows` more rows dropped over an expert's capacity."""
        self.dropped = (self.dropped or 0) + rows

    def add(self, route: torch.Tensor) -> None:
        """Count one dispatch's route ([ep, E] rows per source rank and expert)."""
        self.counts.append(route.sum(0))
        self.ranks.append(route.shape[0])

    def spread(self) -> tuple[float, ...]:
        """(min, mean, max) rows an expert received in one layer's dispatch of one
        micro-batch; () when nothing was dispatched."""
        if not self.counts:
            return ()
        every = torch.cat(self.counts).double()
        return float(every.min()), float(every.mean()), float(every.max())

    def imbalance(self) -> float | None:
        """The rows the busiest ep rank received over the mean, averaged over the dispatches
        that moved rows (what `moe.imbalance` prices); None when none did. Read once a step,
        so the forwards never wait for the device."""
        loads = [per_rank.max() / per_rank.mean() for per_rank in (
            counts.view(ranks, -1).sum(1).double() for counts, ranks in zip(self.counts, self.ranks))
            if per_rank.sum() > 0]
        return float(torch.stack(loads).mean()) if loads else None


def _check_rows(x: torch.Tensor, rows: tuple[torch.Tensor, ...]) -> None:
    for i, r in enumerate(rows):
        if r.shape[0] != x.shape[0]:
            raise ValueError(f"ep_dispatch: rows[{i}] has {r.shape[0]} rows, x has "
                             f"{x.shape[0]}; extra row tensors must be row-aligned with x")


@_collective("all-gather (counts), all-to-all", "all-to-all")
def ep_dispatch(x: torch.Tensor, offs: torch.Tensor, *rows: torch.Tensor, experts: int,
                axis: str = EP) -> tuple[torch.Tensor, ...]:
    """Send each token row to the ep rank that owns its expert.

    x: [N, ...] rows sorted by expert; offs: [E] cumulative row ends (int or
    float); rows: more tensors row-aligned with x (N rows, any trailing
    shape), sent along; `experts`: E, a multiple of the ranks on `axis`.
    Returns `(x_local, offs_local, route, *rows_local)`: this rank's local
    experts' rows expert-major, their cumulative row ends [E/ep] (offs's
    dtype), the [ep, E] int64 route that `ep_combine` needs, and the extra
    tensors' rows in x_local's order.

    Forward: all-gather over `axis` of every rank's rows per expert (the
    route), then one all-to-all of x (one per extra tensor) with uneven
    splits, regrouped from source-major to expert-major. Backward: the
    gradients of x_local and rows_local are un-regrouped and sent back the
    reverse way, to x's order; offs and route get none. One rank (or an
    unbound axis): returns (x, offs, counts as a [1, E] route, *rows).
    """
    if offs.dim() != 1 or offs.numel() != experts:
        raise ValueError(f"ep_dispatch: offs has shape {tuple(offs.shape)}, expected "
                         f"[{experts}] (one cumulative row end per expert)")
    _check_rows(x, rows)
    group = axis_group(axis)
    ep = group_size(group)
    if experts % ep:
        raise ValueError(f"ep_dispatch: {experts} experts do not divide over the {ep} ranks of "
                         f"axis {axis!r}")
    if isinstance(group, ShapeGroup):
        route = torch.empty(ep, experts, dtype=torch.int64, device=offs.device)
        return (_Move.apply(x, None, group, True), offs.new_empty(experts // ep), route,
                *(_Move.apply(r, None, group, True) for r in rows))
    counts = expert_counts(offs.detach())
    if ep == 1:
        return (x, offs, counts.view(1, experts), *rows)
    route = all_gather_flat(counts, group).wait().view(ep, experts)
    routed = RoutedTokens.current()
    if routed is not None:
        routed.add(route)
    plan = _Plan(route, group)
    local_offs = torch.cumsum(plan.per_expert, 0).to(offs.dtype)
    return (_Move.apply(x, plan, group, True), local_offs, route,
            *(_Move.apply(r, plan, group, True) for r in rows))


@_collective("all-to-all", "all-to-all")
def ep_combine(y_local: torch.Tensor, route: torch.Tensor, axis: str = EP) -> torch.Tensor:
    """Send the local experts' output rows back to the ranks their tokens came from.

    y_local: rows in the expert-major order `ep_dispatch` gave (any trailing
    shape); route: the [ep, E] route it returned. Returns the rows in the
    order of the x given to `ep_dispatch` on this rank. Forward: un-regroup
    to source-major, then the reverse all-to-all over `axis`. Backward: the
    gradient goes the dispatch way (all-to-all, regroup expert-major). One
    rank (or an unbound axis): the identity.
    """
    group = axis_group(axis)
    if group_size(group) == 1:
        return y_local
    plan = None if isinstance(group, ShapeGroup) else _Plan(route, group)
    return _Move.apply(y_local, plan, group, False)
