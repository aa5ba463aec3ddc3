"""Re-derive a graph's shapes after a pass made some tensors rank-local, fixing shape arguments.

After the tensor_parallel pass gives a rank 1/t of some parameters, or the
sequence_parallel pass 1/t of the sequence, every op downstream sees smaller
tensors. Most ops adapt by themselves; ops whose *arguments* spell out a
shape (`view(b, s, 12, 64)`, `reshape(b, s, C)` with C read from a full-size
tensor, `split(768, dim=2)`, `expand(...)`) do not. `propagate` runs the
graph on the meta device node by node and rewrites those arguments so that
each op keeps its meaning on the local tensors, then records the local
shapes, dtypes, FLOPs and parameter counts in every node's NodeInfo. A call
whose signature came before (the same op on operands of the same metadata:
every layer after the first of identical ones) reuses that evaluation
(`ptc.compiler.graph.call_cache`), so the cost stays flat in depth.

Terms:
- a node's *before* shape is the one its NodeInfo holds when `propagate`
  starts (full for tensor parallelism, tp-local for sequence parallelism);
  its *local* shape the one it has now;
- a tensor is *split* when exactly one dim of its local shape is its before
  size divided by the degree k (a tensor of several outputs: each output);
- a reshape maps *blocks* of input dims to blocks of output dims with equal
  products; the split dim of the input must be the outermost of its block,
  and the output block's dim that takes the split is the one of a preferred
  size (the heads counts for tensor parallelism: q/k/v are split by heads;
  the sequence length for sequence parallelism), else its outermost one
  divisible by k.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from ptc.compiler.graph import flops as flops_mod
from ptc.compiler.graph.call_cache import CallCache
from ptc.compiler.graph.meta import copy_meta, get_info, update_info
from ptc.compiler.graph.nodes import (ATTENTION_OPS, CREATION_OPS, POINTWISE_OPS, mixes_along,
                                      op_name, where)
from ptc.errors import CompileError
from ptc.ops.comm import ShapeGroup, bind_axes

_RESHAPES = frozenset({"view", "reshape", "unsafe_view"})
_SPLITS = frozenset({"split", "split_with_sizes"})
_BATCHED_OPS = ATTENTION_OPS | {"matmul", "bmm"}
"""Ops that pair their operands' leading (batch, heads) dims, as elementwise ops pair all."""
_PRODUCTS = {"matmul": (0, 1), "bmm": (0, 1), "mm": (0, 1), "baddbmm": (1, 2), "addmm": (1, 2),
             "addbmm": (1, 2)}
"""Matrix products: the argument positions of their first and second operand."""
_SHAPE_ONLY = frozenset({"size", "dim", "getattr"}) | {c for c in CREATION_OPS if c.endswith("_like")}
"""Ops whose output depends only on their input's shape/dtype/device, never on its values."""

ShapeRule = Callable[..., torch.Tensor]
"""A meta stand-in for a collective: (k, *args, **kwargs) -> meta output."""
MixFix = Callable[[fx.Node, fx.Node, int], fx.Node]
"""(node, whole input, dim of the input to split) -> node to use instead of the input."""


@dataclass
class Propagation:
    """What `propagate` found: the before and local shapes of every node."""

    before: dict[fx.Node, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    local: dict[fx.Node, tuple[tuple[int, ...], ...]] = field(default_factory=dict)

    def is_split(self, node: fx.Node) -> bool:
        """Whether some output of the node is smaller than before."""
        return self.local.get(node, ()) != self.before.get(node, ())


def is_shape_only(node: fx.Node) -> bool:
    """Whether the node reads only its input's metadata (size, dtype, *_like creation)."""
    return node.op in ("call_function", "call_method") and op_name(node) in _SHAPE_ONLY


def propagate(gm: fx.GraphModule, *, k: int, prefer: frozenset[int] = frozenset(),
              pick_last: bool = False, rules: Mapping[Callable, ShapeRule] | None = None,
              on_mix: MixFix | None = None, what: str = "tensor parallelism",
              padded: Mapping[int, int] | None = None,
              axes: Mapping[str, int] | None = None,
              advice: Callable[[fx.Node], str] | None = None,
              on_gather: MixFix | None = None) -> Propagation:
    """Run `gm` on meta with its current (local) parameters; fix shape arguments; update meta.

    `k`: the degree a split dim is divided by. `padded`: sizes that become a
    given local size instead (a vocabulary padded to a multiple of k:
    {V: ceil(V / k)}). `prefer`, `pick_last`: which
    output dim of a reshape block takes the split (module docstring).
    `rules`: meta stand-ins for ops that do not compute shapes themselves on
    one process (sequence collectives). `axes`: mesh axes an earlier pass
    split along, by degree: their ops run on ShapeGroups of that size (the
    context-parallel ops of a cp-split graph). `on_mix`: called when an elementwise
    op meets a split and a whole operand of the same size on the split dim
    (the whole one must be split too); without it that is a CompileError.
    `on_gather`: called for each split input of an op that combines elements
    along its split dim (an attention, a matmul over it, a softmax, cumsum or
    convolution along it), which then runs on whole inputs; without it such
    ops run on the local parts.
    Raises CompileError naming the node, its module and source line when an
    op cannot run on the local shapes, followed by `advice(node)` (a fix).
    """
    shapes = {axis: ShapeGroup(size) for axis, size in (axes or {}).items()}
    with bind_axes(shapes):
        return _Propagator(gm, k, prefer, pick_last, dict(rules or {}), on_mix, what,
                           dict(padded or {}), advice, on_gather).run()


class _Unfollowable(Exception):
    """The split dim cannot be followed through a shape op."""


class _Propagator:
    def __init__(self, gm, k, prefer, pick_last, rules, on_mix, what, padded, advice, on_gather):
        self.gm, self.k, self.prefer, self.pick_last = gm, k, prefer, pick_last
        self.rules, self.on_mix, self.what, self.padded = rules, on_mix, what, padded
        self.on_gather = on_gather
        self.advice = advice or (lambda node: "")
        self.interp = fx.Interpreter(gm, garbage_collect_values=False)
        self.env = self.interp.env
        self.result = Propagation()
        self.cache = CallCache(gm)  # identical layers: one evaluation of each call
        self.params: dict[str, int] = {}  # elements each call_module / get_attr target reads

    def run(self) -> Propagation:
        for node in self.gm.graph.nodes:
            self.result.before[node] = _shapes_of(node)
        with torch.no_grad():
            for node in list(self.gm.graph.nodes):
                if node.op == "output":
                    continue
                if node.op != "placeholder":
                    self._fix(node)
                self._evaluate(node)
        return self.result

    # ------------------------------------------------------------ evaluation

    def _evaluate(self, node: fx.Node) -> None:
        args, kwargs = (), {}
        try:
            if node.op == "placeholder":
                meta = get_info(node)
                value = torch.empty(meta.shapes[0], dtype=meta.dtypes[0], device="meta")
            else:
                args, kwargs = self.interp.fetch_args_kwargs_from_env(node)
                value = self.cache.call(node, args, kwargs, lambda: self._run(node, args, kwargs))
        except CompileError:
            raise
        except Exception as exc:
            raise CompileError(f"{self.what}: {where(node)} cannot run on the rank-local "
                               f"shapes ({', '.join(self._input_shapes(node))}): "
                               f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                               f"{self.advice(node)}") from exc
        self.env[node] = value
        self._record(node, value, args, kwargs)

    def _run(self, node: fx.Node, args: tuple, kwargs: dict):
        """The node's value: its shape rule's, else what fx.Interpreter computes for its op."""
        if node.op == "call_function" and node.target in self.rules:
            return self.rules[node.target](self.k, *args, **kwargs)
        return getattr(self.interp, node.op)(node.target, args, kwargs)

    def _input_shapes(self, node: fx.Node) -> list[str]:
        return [f"{a.name}: {tuple(self.env[a].shape)}" for a in node.all_input_nodes
                if isinstance(self.env.get(a), torch.Tensor)]

    def _record(self, node: fx.Node, value, args: tuple, kwargs: dict) -> None:
        tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        shapes = tuple(tuple(t.shape) for t in tensors)
        self.result.local[node] = shapes
        before = self.result.before.setdefault(node, shapes)
        for b, s in zip(before, shapes):
            diff = [d for d in range(len(b)) if len(b) != len(s) or b[d] != s[d]]
            if len(b) != len(s) or len(diff) > 1 or (
                    diff and self._local_size(b[diff[0]]) != s[diff[0]]):
                raise CompileError(f"{self.what}: {where(node)} has local shape {s}, which is "
                                   f"not its shape {b} with one dimension divided by {self.k}"
                                   f"{self.advice(node)}")
        meta = get_info(node)
        if meta is None:
            return
        changes: dict = dict(shapes=shapes, dtypes=tuple(t.dtype for t in tensors))
        if node.op in ("call_function", "call_method", "call_module"):
            changes["flops"] = self._flops(node, meta, value, args, kwargs)
        if node.op in ("call_module", "get_attr"):
            target = str(node.target)
            if target not in self.params:
                self.params[target] = _params_read(self.gm, node)
            params = self.params[target]
            changes.update(params=params, param_bytes=params * meta.dtypes[0].itemsize
                           if params and meta.dtypes else 0)
        if any(getattr(meta, name) != new for name, new in changes.items()):  # else keep it:
            update_info(node, **changes)  # records are frozen, an equal one says the same

    def _local_size(self, size: int) -> int | None:
        """What a split dim of `size` holds on one rank (None: it cannot be split)."""
        if size in self.padded:
            return self.padded[size]
        return size // self.k if size % self.k == 0 else None

    def _split_dim(self, before: tuple[int, ...], local: tuple[int, ...]) -> int:
        diff = [d for d in range(len(before)) if before[d] != local[d]]
        if len(before) != len(local) or len(diff) != 1 or \
                self._local_size(before[diff[0]]) != local[diff[0]]:
            raise _Unfollowable(f"{local} is not {before} with one dim divided by {self.k}")
        return diff[0]

    def _flops(self, node: fx.Node, meta, value, args: tuple, kwargs: dict) -> int:
        if flops_mod.needs_running(node, meta.kind):
            before = sum(math.prod(s) for s in self.result.before[node]) or 1
            after = sum(math.prod(s) for s in self.result.local[node])
            return meta.flops * after // before
        return int(flops_mod.node_flops(node, meta.kind, args, kwargs, value))

    # ---------------------------------------------------------------- fixes

    def _fix(self, node: fx.Node) -> None:
        name = op_name(node)
        try:
            if self.on_gather is not None:
                self._gather_mixed(node)
            if name in _RESHAPES:
                self._fix_reshape(node)
            elif name in _SPLITS:
                self._fix_split(node)
            elif name == "slice":
                self._fix_slice(node)
            elif name == "expand":
                self._fix_expand(node)
            elif name in POINTWISE_OPS or name in _BATCHED_OPS:
                self._fix_mix(node)
        except _Unfollowable as exc:
            raise CompileError(f"{self.what}: {where(node)} reshapes a split tensor in a way "
                               f"the pass cannot follow: {exc}{self.advice(node)}") from None

    def _tensor_arg(self, node: fx.Node) -> fx.Node | None:
        x = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))
        if isinstance(x, fx.Node) and isinstance(self.env.get(x), torch.Tensor):
            return x
        return None

    def _before_local(self, x: fx.Node) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.result.before[x][0], tuple(self.env[x].shape)

    def _fix_reshape(self, node: fx.Node) -> None:
        x = self._tensor_arg(node)
        slot = shape_slot(node)
        if x is None or slot is None or not self.result.before[node]:
            return
        bi, li = self._before_local(x)
        expected = self._reshape_expected(bi, li, self.result.before[node][0])
        self._write_sizes(node, slot, expected)

    def _reshape_expected(self, bi, li, bo) -> tuple[int, ...]:
        if bi == li:
            return bo
        d = self._split_dim(bi, li)
        cut_in, cut_out = _cuts(bi), _cuts(bo)
        common = sorted(set(cut_in) & set(cut_out))
        lo = max(c for c in common if c <= cut_in[d])
        hi = min(c for c in common if c >= cut_in[d + 1])
        block_in = [j for j in range(len(bi)) if cut_in[j] >= lo and cut_in[j + 1] <= hi and bi[j] > 1]
        block = [j for j in range(len(bo)) if cut_out[j] >= lo and cut_out[j + 1] <= hi and bo[j] > 1]
        if block_in and block_in[0] != d and len(block) > 1:
            raise _Unfollowable(f"the split dim {d} of {bi} is not the outermost of the dims "
                                f"{[bi[j] for j in block_in]} it is reshaped with")
        candidates = [j for j in block if self._local_size(bo[j]) is not None]
        preferred = [j for j in candidates if bo[j] in self.prefer]
        pick = preferred or candidates
        if not pick:
            raise _Unfollowable(f"no dim of {[bo[j] for j in block]} in {bo} is divisible by {self.k}")
        j = pick[-1] if self.pick_last else pick[0]
        out = list(bo)
        out[j] = self._local_size(out[j])
        return tuple(out)

    def _write_sizes(self, node: fx.Node, slot, expected: tuple[int, ...]) -> None:
        entries, write = slot
        if len(entries) != len(expected):
            return  # a shape given as one traced value: checked when the node runs
        new, changed = [], False
        for entry, want in zip(entries, expected):
            have = self._value(entry)
            if have == -1 or have == want:
                new.append(entry)
                continue
            new.append(self._rescaled(node, entry, have, want))
            changed = True
        if changed:
            write(new)

    def _value(self, entry):
        return self.env[entry] if isinstance(entry, fx.Node) else entry

    def _rescaled(self, node: fx.Node, entry, have: int, want: int):
        """`entry` (a constant or a traced size) turned from `have` into `want`."""
        if not isinstance(entry, fx.Node):
            return want
        if have % want == 0:
            return self._insert(node, operator.floordiv, (entry, have // want))
        if want % have == 0:
            return self._insert(node, operator.mul, (entry, want // have))
        raise _Unfollowable(f"size {entry.name} = {have} cannot become {want}")

    def _insert(self, node: fx.Node, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
        """A call_function node before `node`, with its metadata, evaluated at once."""
        with self.gm.graph.inserting_before(node):
            new = self.gm.graph.call_function(target, args, kwargs or {})
        copy_meta(node, new, kind="pointwise" if target in (operator.floordiv, operator.mul)
                  else "other", shapes=(), dtypes=(), flops=0, params=0, param_bytes=0)
        self._evaluate(new)
        return new

    def _split_of(self, node: fx.Node) -> tuple[tuple[int, ...], int] | None:
        """(before shape, split dim) of the node's tensor input when it is split, else None."""
        x = self._tensor_arg(node)
        if x is None:
            return None
        bi, li = self._before_local(x)
        return None if bi == li else (bi, self._split_dim(bi, li))

    def _fix_split(self, node: fx.Node) -> None:
        split = self._split_of(node)
        if split is None:
            return
        bi, split_dim = split
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        if dim % len(bi) != split_dim:
            return
        sizes = node.args[1] if len(node.args) > 1 else node.kwargs["split_size_or_sections"]
        if isinstance(sizes, (list, tuple)):
            new = type(sizes)(self._divided(node, s) for s in sizes)
        else:
            new = self._divided(node, sizes)
        args = list(node.args)
        if len(args) > 1:
            args[1] = new
            node.args = tuple(args)
        else:
            node.kwargs = {**node.kwargs, "split_size_or_sections": new}

    def _fix_slice(self, node: fx.Node) -> None:
        """A slice of the split dim (a fused projection's q, k or v piece) takes the same
        piece of the local tensor: its bounds divided by k."""
        split = self._split_of(node)
        if split is None:
            return
        bi, split_dim = split
        args = list(node.args) + [None] * (5 - len(node.args))
        dim = (0 if args[1] is None else args[1]) % len(bi)
        if split_dim != dim or args[4] not in (None, 1):
            return
        for i in (2, 3):
            bound = self._value(args[i])
            if bound is None or not isinstance(bound, int):
                continue
            bound = min(max(bound + bi[dim] if bound < 0 else bound, 0), bi[dim])
            if bound % self.k:
                raise _Unfollowable(f"slice bound {bound} is not divisible by {self.k}")
            args[i] = bound // self.k
        node.args = tuple(args[:max(len(node.args), 4)])

    def _divided(self, node: fx.Node, entry):
        have = self._value(entry)
        if have % self.k:
            raise _Unfollowable(f"split size {have} is not divisible by {self.k}")
        return self._rescaled(node, entry, have, have // self.k)

    def _fix_expand(self, node: fx.Node) -> None:
        x = self._tensor_arg(node)
        slot = shape_slot(node)
        if x is None or slot is None:
            return
        bi, li = self._before_local(x)
        if bi == li:
            return
        expected = list(self.result.before[node][0])
        offset = len(expected) - len(bi)
        for d in range(len(bi)):
            if bi[d] != li[d]:
                expected[offset + d] = li[d]
        self._write_sizes(node, slot, tuple(expected))

    def _split_inputs(self, node: fx.Node) -> dict[fx.Node, int]:
        """The node's split tensor inputs, each with its split dim."""
        split = {}
        for a in node.all_input_nodes:
            if isinstance(self.env.get(a), torch.Tensor) and self.result.before.get(a):
                bi, li = self._before_local(a)
                if bi != li:
                    split[a] = self._split_dim(bi, li)
        return split

    def _gather_mixed(self, node: fx.Node) -> None:
        """Give an op that combines elements along a split dim its inputs whole
        (`on_gather`), so that it runs, and what follows it, on whole tensors."""
        split = self._split_inputs(node)
        if not split or not self._combines_along(node, split):
            return
        for a, dim in split.items():
            whole = self.on_gather(node, a, dim)
            self.result.before[whole] = self.result.before[a]
            self._evaluate(whole)
            node.replace_input_with(a, whole)

    def _combines_along(self, node: fx.Node, split: dict[fx.Node, int]) -> bool:
        """Whether the op mixes elements along one of its inputs' split dims: the positions
        of an attention's queries, keys or mask; a matmul's contraction dim or its second
        operand's columns (the first operand's rows and the batch dims pass through); a
        softmax, cumulative op or convolution along it (`nodes.mixes_along`)."""
        name = op_name(node)
        ndim = {a: self.env[a].dim() for a in split}
        if name in ATTENTION_OPS:
            return any(d >= ndim[a] - 2 for a, d in split.items())
        if name in _PRODUCTS:  # (first, second) operand positions; baddbmm adds args[0]
            first, second = (node.args[i] for i in _PRODUCTS[name])
            return any(d >= ndim[a] - 2 and not (a is first and d == ndim[a] - 2)
                       for a, d in split.items() if a in (first, second))
        return any(mixes_along(node, a, d) for a, d in split.items())

    def _fix_mix(self, node: fx.Node) -> None:
        """Split a whole operand of an op whose other operand is split on a dim they pair:
        any dim of an elementwise op, a leading dim of a matmul or an attention (heads)."""
        inputs = [a for a in node.all_input_nodes if isinstance(self.env.get(a), torch.Tensor)]
        if len(inputs) < 2 or not self.result.before[node]:
            return
        rank = len(self.result.before[node][0])
        paired = (lambda a, d: d < len(self.env[a].shape) - 2) if op_name(node) in _BATCHED_OPS \
            else (lambda a, d: True)
        split_dims = set()
        for a in inputs:
            bi, li = self._before_local(a)
            if bi != li:
                d = self._split_dim(bi, li)
                if not paired(a, d):
                    return
                split_dims.add(rank - len(bi) + d)
        if len(split_dims) != 1:
            return
        (dim,) = split_dims
        for a in inputs:
            bi, li = self._before_local(a)
            own = dim - (rank - len(bi))
            if bi != li or own < 0 or li[own] == 1 or not paired(a, own):
                continue
            if self.on_mix is None:
                raise CompileError(
                    f"{self.what}: {where(node)} combines a split tensor with the whole tensor "
                    f"{a.name} {li}, which is not split; annotate the module that makes it "
                    "(shard \"...\" replicate) or shard its producer")
            part = self.on_mix(node, a, own)
            # Its before shape: as if the whole tensor had k times the part (which is the
            # whole one unless fewer key/value heads than ranks are replicated).
            args, kwargs = self.interp.fetch_args_kwargs_from_env(part)
            size = self._run(part, args, kwargs).shape[own]
            self.result.before[part] = (li[:own] + (size * self.k,) + li[own + 1:],)
            self._evaluate(part)
            node.replace_input_with(a, part)


def fold_sizes(gm: fx.GraphModule) -> int:
    """Replace sizes read off tensors (x.size(1), x.shape[1], x.shape) by the values their
    metadata holds before a pass splits them: the sequence they measure is the whole one,
    whatever part a rank holds. Returns how many were folded.

    So a position table or an `arange` built from the sequence length spans the whole
    sequence (and enters the split through `on_mix`), not the first rank's part on every
    rank. The graph runs only at the plan's micro-batch shape, so the values are the ones
    it always reads. Shape arguments of views then hold the whole size, which `propagate`
    rewrites for the rank's part.
    """
    values: dict[fx.Node, object] = {}
    for node in gm.graph.nodes:
        value = _size_value(node, values)
        if value is not None:
            values[node] = value
    for node, value in values.items():
        for user in list(node.users):
            user.args = _substitute(user.args, node, value)
            user.kwargs = _substitute(user.kwargs, node, value)
    for node in reversed(list(values)):
        if not node.users:
            gm.graph.erase_node(node)
    return len(values)


def _size_value(node: fx.Node, values: dict[fx.Node, object]):
    """The int (or tuple of ints) a shape-reading node gives at capture, else None."""
    name = op_name(node)
    if node.op == "call_method" and name == "size" or \
            node.op == "call_function" and node.target is torch.Tensor.size:
        x, dim = node.args[0], (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"))
        shape = shape_of(x)
        if shape is None:
            return None
        return shape if dim is None else shape[dim]
    if node.op == "call_function" and node.target is getattr and node.args[1] == "shape":
        return shape_of(node.args[0])
    if node.op == "call_function" and node.target is operator.getitem and \
            node.args[0] in values and isinstance(values[node.args[0]], tuple):
        return values[node.args[0]][node.args[1]]
    return None


def shape_of(x) -> tuple[int, ...] | None:
    """The shape a single-tensor node's metadata holds (None: not a node of one tensor)."""
    meta = get_info(x) if isinstance(x, fx.Node) else None
    if meta is None or len(meta.shapes) != 1:
        return None
    return tuple(meta.shapes[0])


def _substitute(args, node: fx.Node, value):
    return fx.node.map_aggregate(args, lambda a: value if a is node else a)


def _shapes_of(node: fx.Node) -> tuple[tuple[int, ...], ...]:
    meta = get_info(node)
    return meta.shapes if meta is not None else ()


def _cuts(shape: tuple[int, ...]) -> list[int]:
    """Prefix products: cut j is the number of elements before dim j's stride starts."""
    out = [1]
    for size in shape:
        out.append(out[-1] * size)
    return out


def shape_slot(node: fx.Node):
    """(size entries, write-back) of a view/reshape/expand's target shape, or None."""
    args = node.args
    if node.op == "call_method":
        if len(args) == 2 and isinstance(args[1], (list, tuple)):
            container = type(args[1])
            return list(args[1]), lambda new: setattr(node, "args", (args[0], container(new)))
        return list(args[1:]), lambda new: setattr(node, "args", (args[0], *new))
    if len(args) > 1 and isinstance(args[1], (list, tuple)):  # torch.reshape / aten ops
        container = type(args[1])
        return list(args[1]), lambda new: setattr(node, "args",
                                                  (args[0], container(new), *args[2:]))
    return None


def _params_read(gm: fx.GraphModule, node: fx.Node) -> int:
    if node.op == "call_module":
        return sum(p.numel() for p in gm.get_submodule(str(node.target)).parameters())
    owner, _, leaf = str(node.target).rpartition(".")
    value = getattr(gm.get_submodule(owner) if owner else gm, leaf, None)
    return value.numel() if isinstance(value, torch.nn.Parameter) else 0
