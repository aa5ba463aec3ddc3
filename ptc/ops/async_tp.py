"""Collective matmuls: sequence-parallel all-gathers and reduce-scatters taken apart into
ring steps that overlap the GEMMs they feed (`parallel.tp_comm = async`).

Terms: the tp ranks form a *ring*; at each *step* a rank sends one sequence
chunk to its neighbour and receives one from the other (point to point, on
gloo and NCCL alike) while it multiplies the chunk it holds. A layer with
sequence parallelism enters its column-parallel block with an all-gather
and leaves its row-parallel linear with a reduce-scatter; with tp ranks
each of them is tp - 1 steps, and every step but the last has a chunk's
GEMM to run beside it (Wang et al., "Overlap Communication with Dependent
Computation via Decomposition", ASPLOS 2023; Megatron-LM's and Transformer
Engine's tp-comm-overlap; PyTorch's async tensor parallelism).

| op                          | forward                                     | backward                                           |
|-----------------------------|---------------------------------------------|----------------------------------------------------|
| `all_gather_linears`        | ring all-gather of x, each chunk's GEMMs    | dx: each chunk's GEMMs, ring reduce-scatter;       |
|                             | while the next chunk travels                | dW: ring all-gather of x again, a GEMM per chunk   |
| `linear_reduce_scatter`     | each chunk's partial GEMM, ring             | ring all-gather of dy, each chunk's dx and dW      |
|                             | reduce-scatter of the partial sums          | while the next chunk travels                       |

They compute what `column_parallel_linears_seq` and a row-parallel linear
followed by `reduce_scatter_seq` compute; only the order of the sums over
ranks (and of a GEMM's rows, now in chunks) differs. `ptc.passes.tp_overlap`
puts them in the graph.

Chunk c of a tensor is its c-th of tp equal pieces along the sequence
dimension `dim` (rank c's chunk of the split sequence).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from ptc.ops.comm import Group, ShapeGroup, Work, axis_group, group_rank, group_size, note
from ptc.ops.tp_ops import TP, _collective, _input_grad, _weight_grad


class _Shift:
    """One ring step in flight: `wait()` gives the chunk received from the neighbour."""

    __slots__ = ("_works",)

    def __init__(self, works: list[Work]):
        self._works = works

    def wait(self) -> torch.Tensor:
        """Block until this rank's send and receive are done (counted as exposed
        communication, `ptc.ops.comm.comm_wait_seconds`); the received chunk."""
        return [work.wait() for work in self._works][-1]


class Ring:
    """This process's place in the ring of an axis's group: rank r sends to r + 1 and
    receives from r - 1 (`forward`), or the other way round."""

    def __init__(self, group: Group):
        self.group, self.size, self.rank = group, group_size(group), group_rank(group)

    def shift(self, chunk: torch.Tensor, *, forward: bool = True) -> _Shift:
        """Start sending `chunk` one rank along the ring and receiving the chunk the rank
        behind sends (the same shape and dtype)."""
        chunk = chunk.contiguous()
        received = torch.empty_like(chunk)
        if isinstance(self.group, ShapeGroup):  # the verifier's shape run: nothing moves
            return _Shift([Work(None, received)])
        note("ring_shift", self.group, chunk)
        step = 1 if forward else -1
        ops = [dist.P2POp(dist.isend, chunk, group=self.group,
                          group_peer=(self.rank + step) % self.size),
               dist.P2POp(dist.irecv, received, group=self.group,
                          group_peer=(self.rank - step) % self.size)]
        send, recv = dist.batch_isend_irecv(ops)
        return _Shift([Work(send, chunk), Work(recv, received)])


def _piece(x: torch.Tensor, dim: int, index: int, parts: int) -> torch.Tensor:
    """Chunk `index` of `parts` equal pieces of x along `dim`."""
    size = x.shape[dim] // parts
    return x.narrow(dim, index * size, size)


def ring_gather_map(ring: Ring, chunk: torch.Tensor, use) -> None:
    """Call `use(source, held)` for every rank's chunk (`source` the rank it came from),
    this rank's own first, each while the next one travels: an all-gather in ring steps."""
    held = chunk
    for step in range(ring.size):
        pending = ring.shift(held) if step < ring.size - 1 else None
        use((ring.rank - step) % ring.size, held)
        if pending is not None:
            held = pending.wait()


def ring_reduce_scatter(ring: Ring, partial) -> torch.Tensor:
    """The sum over ranks of `partial(c)` for c = this rank's chunk: each rank computes
    its partial of the chunk it passes on while the running sum of the previous one
    travels; the sum of chunk c ends on rank c (a reduce-scatter in ring steps)."""
    total = None
    pending = None
    for step in range(ring.size):
        part = partial((ring.rank + step + 1) % ring.size)
        if pending is not None:
            part = part + pending.wait()
        if step < ring.size - 1:
            pending = ring.shift(part, forward=False)
        total = part
    return total


class _AllGatherLinears(torch.autograd.Function):
    """Inputs: x, axis, dim, has_bias (one flag per weight), *weights, *present biases."""

    @staticmethod
    def forward(ctx, x, axis, dim, has_bias, *params):  # noqa: D102 - autograd.Function protocol
        n = len(has_bias)
        weights, present = params[:n], iter(params[n:])
        biases = [next(present) if flag else None for flag in has_bias]
        ring = Ring(axis_group(axis))
        parts: list[list[torch.Tensor | None]] = [[None] * ring.size for _ in weights]

        def multiply(source: int, held: torch.Tensor) -> None:
            for out, w, b in zip(parts, weights, biases):
                out[source] = F.linear(held, w, b)

        ring_gather_map(ring, x, multiply)
        ctx.save_for_backward(x, *weights)  # the rank's chunk: gathered again in backward
        ctx.axis, ctx.dim = axis, dim
        ctx.biased = [i for i, flag in enumerate(has_bias) if flag]
        return tuple(torch.cat(out, dim) for out in parts)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):  # noqa: D102
        x, *weights = ctx.saved_tensors
        ring, n, dim = Ring(axis_group(ctx.axis)), len(weights), ctx.dim
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[4:4 + n]
        need_b = ctx.needs_input_grad[4 + n:]
        grad_x = None
        if need_x:
            grad_x = ring_reduce_scatter(ring, lambda c: _input_grad(
                tuple(_piece(g, dim, c, ring.size) for g in grads), weights))
        grad_w: list[torch.Tensor | None] = [None] * n
        if any(need_w):
            def accumulate(source: int, held: torch.Tensor) -> None:
                for i, need in enumerate(need_w):
                    if need:
                        part = _weight_grad(_piece(grads[i], dim, source, ring.size), held)
                        grad_w[i] = part if grad_w[i] is None else grad_w[i].add_(part)

            ring_gather_map(ring, x, accumulate)
        grad_b = [grads[i].reshape(-1, grads[i].shape[-1]).sum(0) if need else None
                  for i, need in zip(ctx.biased, need_b)]
        return (grad_x, None, None, None, *grad_w, *grad_b)


@_collective("all-gather in ring steps beside the GEMMs",
             "reduce-scatter and all-gather in ring steps beside the GEMMs")
def all_gather_linears(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                       biases: tuple[torch.Tensor | None, ...], dim: int = 1,
                       axis: str = TP) -> tuple[torch.Tensor, ...]:
    """`all_gather_seq` of the rank's sequence chunk x and the column-parallel linears that
    read it, as a collective matmul (module docstring).

    Forward: each rank's chunk travels round the ring while the chunk held is
    multiplied by every `weights[i]` (plus `biases[i]`); outputs are the
    linears' outputs over the whole sequence. Only the chunk is kept for
    backward. Backward: dL/dx = sum_i grad_i @ W_i chunk by chunk, each
    chunk's partial sum passed round the ring and added to (a reduce-scatter
    in steps); then the chunks of x travel round again while each one's
    weight gradients grad_i[c]ᵀ x[c] are added up.
    """
    if len(weights) != len(biases) or not weights:
        raise ValueError(f"all_gather_linears: {len(weights)} weights and {len(biases)} "
                         "biases; give one bias (or None) per weight, at least one weight")
    has_bias = tuple(b is not None for b in biases)
    return _AllGatherLinears.apply(x, axis, dim, has_bias, *weights,
                                   *(b for b in biases if b is not None))


class _LinearReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, dim, axis):  # noqa: D102
        ring = Ring(axis_group(axis))
        out = ring_reduce_scatter(ring, lambda c: F.linear(_piece(x, dim, c, ring.size), weight))
        ctx.save_for_backward(x, weight)
        ctx.dim, ctx.axis = dim, axis
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # noqa: D102
        x, weight = ctx.saved_tensors
        ring, dim = Ring(axis_group(ctx.axis)), ctx.dim
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        parts: list[torch.Tensor | None] = [None] * ring.size
        grad_w = [None]

        def use(source: int, held: torch.Tensor) -> None:
            if need_x:
                parts[source] = held.matmul(weight)
            if need_w:
                part = _weight_grad(held, _piece(x, dim, source, ring.size))
                grad_w[0] = part if grad_w[0] is None else grad_w[0].add_(part)

        ring_gather_map(ring, grad, use)
        grad_x = torch.cat(parts, dim) if need_x else None
        return grad_x, grad_w[0], None, None


@_collective("reduce-scatter in ring steps beside the GEMMs",
             "all-gather in ring steps beside the GEMMs")
def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, dim: int = 1,
                          axis: str = TP) -> torch.Tensor:
    """A row-parallel linear (no bias: it is added after the sum) and the `reduce_scatter_seq`
    of its partial output, as a collective matmul (module docstring).

    Forward: for each chunk of the sequence in ring order, the rank's partial
    product x[c] Wᵀ is added to the running sum received from the next rank
    and passed on; the sum of chunk r ends on rank r. Backward: the output
    gradient's chunks travel round the ring while each one's input gradient
    dy[c] W and weight gradient dy[c]ᵀ x[c] are computed.
    """
    return _LinearReduceScatter.apply(x, weight, dim, axis)
