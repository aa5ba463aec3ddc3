"""Tensor- and sequence-parallel ops that lowered graphs call, each autograd-aware.

Megatron-LM's pairs, by the names the tensor_parallel and sequence_parallel
passes put in the graph (the forward graph shows every collective; each
docstring says what backward does):

| op                    | forward                        | backward                      |
|-----------------------|--------------------------------|-------------------------------|
| `copy_to_tp`          | identity                       | all-reduce (sum) over tp      |
| `tp_part`             | keep this rank's part          | zeros outside the part        |
| `enter_tp_part`       | keep this rank's part          | zero-pad, all-reduce over tp  |
| `reduce_from_tp`      | all-reduce (sum) over tp       | identity                      |
| `all_gather_seq`      | all-gather along the sequence  | reduce-scatter along it       |
| `reduce_scatter_seq`  | reduce-scatter along sequence  | all-gather along it           |
| `scatter_seq`         | keep this rank's sequence chunk| all-gather along it           |
| `gather_seq`          | all-gather along the sequence  | keep this rank's chunk        |

`column_parallel_linears` (`column_parallel_linears_seq`) is `copy_to_tp`
(`all_gather_seq`) fused with the column-parallel linears that read its
output, so that backward can start the all-reduce (reduce-scatter) of the
input's gradient and compute the weight gradients while it travels;
`ptc.passes.tp_overlap` puts them in the graph. Then there are the
vocabulary-parallel embedding lookup and cross-entropy, whose
rank's slice of the vocabulary is rows [rank·V/t, (rank+1)·V/t) of the table.

Ops name a mesh axis ("tp"), never a process group: `ptc.ops.comm`
binds axes to groups at run time. An unbound axis, or a group of one rank,
makes every op local, so a lowered graph also runs in one plain process.

Each communicating op carries `ptc_collective = (forward, backward)`, which
`ptc.views.inspect` reads to highlight collectives without importing
the runtime.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from ptc.ops.comm import Work, all_gather_flat, all_reduce_flat, axis_group, group_rank, \
    group_size, reduce_scatter_flat
from ptc.ops.seq_regather import current_session

TP = "tp"
"""The mesh axis of tensor parallelism."""


def _collective(forward: str, backward: str):
    """Mark an op as a collective (read by ptc.views.inspect)."""
    def mark(fn):
        fn.ptc_collective = (forward, backward)
        return fn
    return mark


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    # A fresh buffer: the input may still be needed by autograd or by other users.
    out = x.contiguous().clone()
    all_reduce_flat(out.view(-1), group, op).wait()  # waited through Work: counted as exposed
    return out


class _Pending:
    """A collective in flight on a tensor moved to dim 0 and flattened: `wait()` gives the
    result as a `shape` tensor with its dim 0 moved back to `dim`."""

    __slots__ = ("_work", "_shape", "_dim", "_result")

    def __init__(self, work: Work, shape: tuple[int, ...], dim: int,
                 result: torch.Tensor | None = None):
        self._work, self._shape, self._dim, self._result = work, shape, dim, result

    def wait(self) -> torch.Tensor:
        """Block until done; the result, contiguous, with `dim` where it was, and a tensor of
        its own (not a view of the flat buffer: a model may add to it in place)."""
        flat = self._work.wait()
        if self._result is not None:
            return self._result
        return flat.view(self._shape).movedim(0, self._dim).contiguous()


def _result_buffer(x: torch.Tensor, shape: tuple[int, ...], dim: int) -> torch.Tensor | None:
    """The tensor a collective can write its result into directly, when moving dim 0 of
    `shape` back to `dim` keeps the memory layout (every dim before `dim` has size 1)."""
    moved_back = (*shape[1:dim + 1], shape[0], *shape[dim + 1:])
    if any(size != 1 for size in moved_back[:dim]):
        return None
    return torch.empty(moved_back, dtype=x.dtype, device=x.device)


def _start_gather(x: torch.Tensor, dim: int, group) -> _Pending | torch.Tensor:
    """Start concatenating every rank's x along `dim` (rank order); x itself on one rank."""
    world = group_size(group)
    if world == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    shape = (world * moved.shape[0], *moved.shape[1:])
    result = _result_buffer(x, shape, dim)
    work = all_gather_flat(moved.reshape(-1), group,
                           out=result.view(-1) if result is not None else None)
    return _Pending(work, shape, dim, result)


def _start_reduce_scatter(x: torch.Tensor, dim: int, group) -> _Pending | torch.Tensor:
    """Start summing x over ranks, keeping this rank's chunk along `dim`; x itself on one rank."""
    world = group_size(group)
    if world == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    if moved.shape[0] % world:
        raise ValueError(f"reduce_scatter_seq: dim {dim} of size {moved.shape[0]} is not "
                         f"divisible by the {world} ranks")
    shape = (moved.shape[0] // world, *moved.shape[1:])
    result = _result_buffer(x, shape, dim)
    work = reduce_scatter_flat(moved.reshape(-1), group,
                               out=result.view(-1) if result is not None else None)
    return _Pending(work, shape, dim, result)


def _done(pending: _Pending | torch.Tensor) -> torch.Tensor:
    return pending.wait() if isinstance(pending, _Pending) else pending


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's x along `dim`, in rank order."""
    return _done(_start_gather(x, dim, group))


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum x over ranks and keep this rank's chunk along `dim`."""
    return _done(_start_reduce_scatter(x, dim, group))


def _chunk(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's chunk of x along `dim`."""
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"a sequence chunk: dim {dim} of size {x.shape[dim]} is not divisible "
                         f"by the {world} ranks")
    chunk = x.chunk(world, dim)[group_rank(group)]
    if not x.requires_grad:  # a table: its view, as the model's own slice of it would be
        return chunk
    # A tensor of its own, not a view of x: a model may add to it in place.
    return chunk.clone(memory_format=torch.contiguous_format)


def _gather_in_layout(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """`_gather` with the result laid out in memory as x is (a transposed view stays one):
    the op reading it then makes what it would make from x (an attention kernel's output
    strides follow its query's), and no copy appears where the model reshapes it."""
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))  # outermost in memory first
    if order == list(range(x.dim())) or not x.permute(order).is_contiguous():
        return _gather(x, dim, group)
    whole = _gather(x.permute(order), order.index(dim), group)
    return whole.permute([order.index(d) for d in range(x.dim())])


# ------------------------------------------------------------ tensor parallel


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):  # noqa: D102 - autograd.Function protocol
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return _all_reduce(grad, axis_group(ctx.axis)), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):  # noqa: D102
        return _all_reduce(x, axis_group(axis))

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return grad, None


@_collective("identity", "all-reduce")
def copy_to_tp(x: torch.Tensor, axis: str = TP) -> torch.Tensor:
    """Enter a tensor-parallel region: the input of column-parallel linears.

    Forward: identity (every tp rank holds the same x). Backward: all-reduce
    (sum) of the gradient over `axis`, since each rank's column shard only
    contributes part of dL/dx. Applied to a parameter, it sums the
    parameter's gradient over the ranks that each saw part of the data
    (norms under sequence parallelism).
    """
    return _CopyToTP.apply(x, axis)


@_collective("all-reduce", "identity")
def reduce_from_tp(x: torch.Tensor, axis: str = TP) -> torch.Tensor:
    """Leave a tensor-parallel region: sum the partial outputs of a row-parallel linear.

    Forward: all-reduce (sum) over `axis`. Backward: identity (the summed
    output's gradient is every rank's partial output's gradient).
    """
    return _ReduceFromTP.apply(x, axis)


class _TPPart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, parts, tp, axis):  # noqa: D102
        group = axis_group(axis)
        if group is not None and group_size(group) != tp:
            raise ValueError(f"tp_part: lowered for tp = {tp}, run on {group_size(group)} ranks")
        ctx.dim, ctx.parts, ctx.shape, ctx.axis = dim, parts, tuple(x.shape), axis
        ctx.index = group_rank(group) * parts // tp
        return x.chunk(parts, dim)[ctx.index].contiguous()

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        whole = grad.new_zeros(ctx.shape)
        whole.chunk(ctx.parts, ctx.dim)[ctx.index].copy_(grad)
        return whole, None, None, None, None


class _EnterTPPart(_TPPart):
    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        whole, *rest = _TPPart.backward(ctx, grad)
        return _all_reduce(whole, axis_group(ctx.axis)), *rest


def tp_part(x: torch.Tensor, dim: int, parts: int, tp: int, axis: str = TP) -> torch.Tensor:
    """This tp rank's part of a tensor every rank holds whole, where it meets a split one.

    x is cut into `parts` equal pieces along `dim`; rank r of the `tp` ranks
    keeps piece r·parts/tp: its own 1/tp when parts = tp (a key/value tensor
    whose heads were repeated to the query heads), or, when fewer key/value
    heads than ranks are replicated (parts < tp), the one head its query
    heads read. Forward: no communication. Backward: the gradient in the
    rank's piece, zeros elsewhere; what produced x sums it over tp (its
    input's `copy_to_tp`, its weights as partial gradients).
    """
    return _TPPart.apply(x, dim, parts, tp, axis)


@_collective("split", "all-reduce")
def enter_tp_part(x: torch.Tensor, dim: int, parts: int, tp: int, axis: str = TP) -> torch.Tensor:
    """`tp_part` of a tensor computed whole outside any tensor-parallel region (a replicated
    projection, a bias table): forward the same; backward the zero-padded gradient summed
    over tp, so the replicated producer sees the whole gradient on every rank."""
    return _EnterTPPart.apply(x, dim, parts, tp, axis)


# ---------------------------------------------------------- sequence parallel


class _AllGatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis):  # noqa: D102
        ctx.dim, ctx.axis, ctx.session = dim, axis, current_session()
        out = _gather(x, dim, axis_group(axis))
        if ctx.session is not None and out is not x:
            # Backward keeps only this rank's chunk of what the next linears save.
            chunk = x.detach()
            ctx.key = ctx.session.track(out, chunk, lambda t: _gather(t, dim, axis_group(axis)))
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        if ctx.session is not None and hasattr(ctx, "key"):
            ctx.session.release(ctx.key)
        return _reduce_scatter(grad, ctx.dim, axis_group(ctx.axis)), None, None


class _SeqMove(torch.autograd.Function):
    """A sequence op whose forward is `forward(x, dim, group)` and whose backward is
    `backward(grad, dim, group)` (`_gather`, `_reduce_scatter` or `_chunk`)."""

    @staticmethod
    def forward(ctx, x, dim, axis, forward, backward):  # noqa: D102
        ctx.dim, ctx.axis, ctx.move_back = dim, axis, backward
        return forward(x, dim, axis_group(axis))

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return ctx.move_back(grad, ctx.dim, axis_group(ctx.axis)), None, None, None, None


@_collective("all-gather", "reduce-scatter")
def all_gather_seq(x: torch.Tensor, dim: int = 1, axis: str = TP) -> torch.Tensor:
    """Leave a sequence-parallel region: join every rank's sequence chunk along `dim`.

    Forward: all-gather along `dim` over `axis` (rank order). Backward:
    reduce-scatter (sum) of the gradient along `dim`: the column-parallel
    linears after it each produce a partial gradient of the full sequence.
    Under a `SeqRegather` session what autograd saves of the output is kept
    as this rank's chunk and all-gathered again in backward.
    """
    return _AllGatherSeq.apply(x, dim, axis)


@_collective("reduce-scatter", "all-gather")
def reduce_scatter_seq(x: torch.Tensor, dim: int = 1, axis: str = TP) -> torch.Tensor:
    """Enter a sequence-parallel region from a row-parallel linear's partial sums.

    Forward: reduce-scatter (sum) along `dim` over `axis`: each rank keeps
    its chunk of the summed sequence. Backward: all-gather of the gradient
    along `dim`.
    """
    return _SeqMove.apply(x, dim, axis, _reduce_scatter, _gather)


@_collective("split", "all-gather")
def scatter_seq(x: torch.Tensor, dim: int = 1, axis: str = TP) -> torch.Tensor:
    """Enter a sequence-parallel region from a replicated tensor (learned positions).

    Forward: keep this rank's chunk along `dim` (no communication).
    Backward: all-gather of the gradient along `dim`, so the replicated
    producer sees the gradient of the whole sequence.
    """
    return _SeqMove.apply(x, dim, axis, _chunk, _gather)


@_collective("all-gather", "split")
def gather_seq(x: torch.Tensor, dim: int = 1, axis: str = TP) -> torch.Tensor:
    """Give an op that mixes positions (an attention whose projections a rule keeps whole)
    the whole sequence from a sequence-parallel region.

    Forward: all-gather along `dim` over `axis`. Backward: keep this rank's
    chunk of the gradient, with no sum: what runs on the gathered tensor
    runs whole and alike on every rank, so each rank's gradient there is
    already the whole one (unlike `all_gather_seq`, whose users are
    column-parallel and give partial gradients).
    """
    return _SeqMove.apply(x, dim, axis, _gather_in_layout, _chunk)


# ------------------------------------- column-parallel linears, overlapped in backward


def _start_all_reduce(x: torch.Tensor, group) -> _Pending | torch.Tensor:
    """Start summing x (a fresh contiguous buffer, reduced in place) over ranks; x on one rank."""
    if group_size(group) == 1:
        return x
    return _Pending(all_reduce_flat(x.view(-1), group), tuple(x.shape), 0)


def _input_grad(grads: tuple[torch.Tensor, ...], weights: list[torch.Tensor]) -> torch.Tensor:
    """sum_i grad_i @ W_i, accumulated in one buffer: dL/dx of linears sharing their input x."""
    total = None
    for grad, weight in zip(grads, weights):
        rows = grad.reshape(-1, grad.shape[-1])
        total = rows.mm(weight) if total is None else total.addmm_(rows, weight)
    return total.view(*grads[0].shape[:-1], weights[0].shape[1])


def _weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad^T @ x over every token: dL/dW of one linear."""
    return grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


class _ColumnParallelLinears(torch.autograd.Function):
    """Inputs: x, axis, dim (None: no gather), has_bias (one flag per weight), *weights, *biases.

    Only the present biases are passed (autograd sees tensors, not tuples of them).
    """

    @staticmethod
    def forward(ctx, x, axis, dim, has_bias, *params):  # noqa: D102
        n = len(has_bias)
        weights, present = params[:n], iter(params[n:])
        biases = [next(present) if flag else None for flag in has_bias]
        full = x if dim is None else _gather(x, dim, axis_group(axis))
        # Saved as received: under sequence parallelism the rank's chunk, gathered again in
        # backward (the memory a SeqRegather session gives all_gather_seq, session or not).
        # Weights go through save_for_backward so ZeRO-3's hooks keep them as references.
        ctx.save_for_backward(x, *weights)
        ctx.axis, ctx.dim = axis, dim
        ctx.biased = [i for i, flag in enumerate(has_bias) if flag]  # linears with a bias
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases))

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):  # noqa: D102
        x, *weights = ctx.saved_tensors
        group, n = axis_group(ctx.axis), len(weights)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[4:4 + n]
        need_b = ctx.needs_input_grad[4 + n:]
        full = x
        if ctx.dim is not None and any(need_w):
            full = _start_gather(x, ctx.dim, group)  # travels while grad_x is computed
        grad_x = None
        if need_x:
            grad_x = _input_grad(grads, weights)
            grad_x = _start_reduce_scatter(grad_x, ctx.dim, group) if ctx.dim is not None \
                else _start_all_reduce(grad_x, group)
        # The reduction of grad_x is in flight: weight and bias gradients overlap it.
        full = _done(full)
        grad_w = [_weight_grad(g, full) if need else None for g, need in zip(grads, need_w)]
        grad_b = [grads[i].reshape(-1, grads[i].shape[-1]).sum(0) if need else None
                  for i, need in zip(ctx.biased, need_b)]
        return (_done(grad_x) if need_x else None, None, None, None, *grad_w, *grad_b)


def _column_parallel(x: torch.Tensor, weights, biases, axis: str,
                     dim: int | None) -> tuple[torch.Tensor, ...]:
    if len(weights) != len(biases) or not weights:
        raise ValueError(f"column_parallel_linears: {len(weights)} weights and {len(biases)} "
                         "biases; give one bias (or None) per weight, at least one weight")
    has_bias = tuple(b is not None for b in biases)
    return _ColumnParallelLinears.apply(x, axis, dim, has_bias, *weights,
                                        *(b for b in biases if b is not None))


@_collective("identity", "all-reduce (async, overlaps weight gradients)")
def column_parallel_linears(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                            biases: tuple[torch.Tensor | None, ...],
                            axis: str = TP) -> tuple[torch.Tensor, ...]:
    """`copy_to_tp` and the column-parallel linears that read its output, as one op.

    Forward: `F.linear(x, weights[i], biases[i])` for each i (q, k, v; gate,
    up; or a single linear); no communication, as `copy_to_tp`. Backward:
    dL/dx = sum_i grad_i @ W_i, then the all-reduce (sum) over `axis` of it
    is started and every weight and bias gradient is computed while it runs
    (Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication); the op
    waits for the sum only at its end. Gradients equal those of copy_to_tp
    followed by the linears, in the inputs' dtypes.
    """
    return _column_parallel(x, weights, biases, axis, None)


@_collective("all-gather", "all-gather again, reduce-scatter (async, overlaps weight gradients)")
def column_parallel_linears_seq(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                                biases: tuple[torch.Tensor | None, ...], dim: int = 1,
                                axis: str = TP) -> tuple[torch.Tensor, ...]:
    """`all_gather_seq` and the column-parallel linears that read its output, as one op.

    Forward: all-gather of the rank's sequence chunk x along `dim` over
    `axis`, then `F.linear(full, weights[i], biases[i])` for each i. Only the
    chunk is kept for backward. Backward: the chunk's all-gather is started
    again, dL/dfull = sum_i grad_i @ W_i is computed meanwhile, then its
    reduce-scatter along `dim` is started and the weight and bias gradients
    (which need the gathered input) are computed while it runs. Gradients
    equal those of all_gather_seq followed by the linears.
    """
    return _column_parallel(x, weights, biases, axis, dim)


# ------------------------------------------------------- vocabulary parallel


def _vocab_range(rows: int, axis: str) -> int:
    """First vocabulary id of this rank's slice of `rows` table rows."""
    return group_rank(axis_group(axis)) * rows


class _VocabEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, weight, axis, padding_idx):  # noqa: D102
        start = _vocab_range(weight.shape[0], axis)
        outside = (tokens < start) | (tokens >= start + weight.shape[0])
        local = (tokens - start).masked_fill(outside, 0)
        out = F.embedding(local, weight).masked_fill_(outside.unsqueeze(-1), 0)
        # Only the token ids are kept (as torch's embedding keeps them); the
        # mask and local ids are cheap to recompute in backward.
        ctx.save_for_backward(tokens)
        ctx.rows, ctx.axis, ctx.start, ctx.padding_idx = weight.shape[0], axis, start, padding_idx
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        (tokens,) = ctx.saved_tensors
        outside = (tokens < ctx.start) | (tokens >= ctx.start + ctx.rows)
        local = (tokens - ctx.start).masked_fill(outside, 0).reshape(-1)
        skip = outside if ctx.padding_idx is None else outside | (tokens == ctx.padding_idx)
        rows = grad.masked_fill(skip.unsqueeze(-1), 0).reshape(-1, grad.shape[-1])
        gw = torch.zeros(ctx.rows, grad.shape[-1], dtype=grad.dtype, device=grad.device)
        return None, gw.index_add_(0, local, rows), None, None


def vocab_parallel_embedding(tokens: torch.Tensor, weight: torch.Tensor,
                             axis: str = TP, padding_idx: int | None = None) -> torch.Tensor:
    """Look tokens up in this rank's slice of a vocabulary-sharded embedding table.

    Rows of `weight` are vocabulary ids [rank·V/t, (rank+1)·V/t); tokens
    outside that range give zero vectors, so summing over tp (the
    `reduce_from_tp` or `reduce_scatter_seq` the pass puts after it) yields
    the full lookup. Forward: no communication. Backward: the rank's rows'
    gradient (zero for ids outside its slice and, as torch's embedding, for
    the global id `padding_idx`), no communication.
    """
    return _VocabEmbedding.apply(tokens, weight, axis, padding_idx)


class _VocabCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index, reduction, axis, vocab_size):  # noqa: D102
        group = axis_group(axis)
        rows = logits.shape[-1]
        x = logits.reshape(-1, rows).float()
        t = targets.reshape(-1)
        start = _vocab_range(rows, axis)
        if vocab_size is not None and start + rows > vocab_size:  # padding rows: no token
            padding = torch.arange(max(vocab_size - start, 0), rows, device=x.device)
            x = x.index_fill(1, padding, -math.inf)  # not in place: x may be the logits
        peak = _all_reduce(x.detach().amax(dim=-1), group, dist.ReduceOp.MAX)
        x = x - peak.unsqueeze(-1)
        mine = (t >= start) & (t < start + rows)
        local = (t - start).masked_fill(~mine, 0)
        target_logit = x.gather(1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        exp = x.exp_()
        # One all-reduce for both sums: [sum exp, target logit] per token.
        sums = _all_reduce(torch.stack([exp.sum(-1), target_logit]), group)
        losses = sums[0].log() - sums[1]
        valid = t != ignore_index
        losses = losses.masked_fill(~valid, 0.0)
        count = valid.sum()
        if reduction == "mean":
            loss = losses.sum() / count
        elif reduction == "sum":
            loss = losses.sum()
        else:
            loss = losses.view(targets.shape)
        softmax = exp.div_(sums[0].unsqueeze(-1)).to(logits.dtype)
        ctx.save_for_backward(softmax, targets)
        ctx.meta = (ignore_index, reduction, axis, start, logits.shape, count)
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        softmax, targets = ctx.saved_tensors
        ignore_index, reduction, _, start, shape, count = ctx.meta
        rows = softmax.shape[-1]
        t = targets.reshape(-1)
        mine = (t >= start) & (t < start + rows)
        local = (t - start).masked_fill(~mine, 0)
        g = softmax.to(torch.float32, copy=True)
        g.scatter_add_(1, local.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        scale = (t != ignore_index).to(g.dtype)
        if reduction == "mean":
            scale = scale * (grad.float() / count)
        elif reduction == "sum":
            scale = scale * grad.float()
        else:
            scale = scale * grad.float().reshape(-1)
        return (g * scale.unsqueeze(-1)).to(softmax.dtype).view(shape), None, None, None, None, \
            None


@_collective("all-reduce (max, sums)", "local")
def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 axis: str = TP, vocab_size: int | None = None) -> torch.Tensor:
    """Cross-entropy of vocabulary-sharded logits[..., V/t] against full targets[...].

    Each rank holds logits for its vocabulary slice; the full logits are never
    gathered. Forward: all-reduce (max) of the per-token maximum, then one
    all-reduce (sum) of the per-token sum of exponentials and target logit;
    the result equals `F.cross_entropy` on the full logits (`ignore_index`,
    `reduction` "mean" / "sum" / "none" as there). Backward: local, no
    communication: softmax minus the one-hot target on the rank's slice.
    `vocab_size`: the true vocabulary when the table is padded to a multiple
    of t; the logits of rows from there on are left out (no gradient).
    """
    return _VocabCrossEntropy.apply(logits, targets, ignore_index, reduction, axis, vocab_size)


TP_OPS = (copy_to_tp, reduce_from_tp, all_gather_seq, reduce_scatter_seq, scatter_seq,
          column_parallel_linears, column_parallel_linears_seq, vocab_parallel_embedding,
          vocab_parallel_cross_entropy)
"""Every op of this module, for passes and reports that look for them."""
