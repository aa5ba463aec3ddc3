"""The shard_tensors pass: keep 1/tp of every split weight and insert Megatron's collectives.

Given the split `ptc.compiler.graph.tp_structure` finds (or the plan's rules say),
the pass rewrites the captured graph into the graph every tp rank runs:

- a column-parallel linear (q/k/v, MLP up/gate, the vocabulary-parallel LM
  head) keeps 1/tp of its output features and reads its input through
  `copy_to_tp` (one per input tensor: q, k and v share theirs);
- a row-parallel linear (attention output, MLP down) keeps 1/tp of its
  input features; its partial output goes through `reduce_from_tp`, and its
  bias, replicated, is added after the sum;
- a head shared by all heads (MLA's rotary key, `tp_structure.SharedHead`) is
  expanded to the rank's own heads, what it is computed from entering the
  split through `copy_to_tp`;
- the token embedding becomes `vocab_parallel_embedding` of the rank's
  vocabulary rows followed by `reduce_from_tp`, and the loss
  `vocab_parallel_cross_entropy` of the rank's logits (never gathered);
- shape arguments between them (head counts, fused-projection splits,
  sizes read from full tensors) are rewritten for the local tensors
  (`ptc.passes.local_shapes`).

The parameters of the graph module get their tp-local shapes (on meta);
how each maps to the full tensor is left in the graph's record as a
`TensorParallelLayout` for the Program and the runtime.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from ptc.compiler.records.decisions import Decisions
from ptc.compiler.graph.meta import copy_meta, get_info, graph_record, update_graph_record
from ptc.compiler.graph.nodes import (GROUPED_MM_OPS, TRANSPARENT_OPS, is_linear, linear_in_dim,
                                      linear_out_dim, linear_weight, module_of, op_name,
                                      param_source, params_behind, walk, where)
from ptc.compiler.records.tp_layout import ParamShard, TensorParallelLayout
from ptc.errors import CompileError
from ptc.ops.tp_ops import (copy_to_tp, enter_tp_part, reduce_from_tp, tp_part,
                            vocab_parallel_cross_entropy, vocab_parallel_embedding)
from ptc.passes.cat_form import to_cat_form
from ptc.passes.functional import functionalize
from ptc.passes.linear_form import to_linear_form
from ptc.passes.local_params import param_aliases, set_local_param
from ptc.passes.local_shapes import Propagation, is_shape_only, propagate, shape_slot
from ptc.compiler.graph.tp_structure import (COLWISE, ROWWISE, VOCAB, SharedHead, Sharding,
                                             find_sharding, layer_glob)

log = logging.getLogger("ptc.passes.shard_tensors")

_FREE = dict(flops=0, params=0, param_bytes=0)
_CE_SIGNATURE = inspect.signature(F.cross_entropy)
_ATEN_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def shard_tensors_pass(gm: fx.GraphModule, decisions: Decisions) -> fx.GraphModule:
    """Insert copy_to_tp / reduce_from_tp around tp-split linears and keep 1/tp of their weights.

    Tensor parallelism divides a layer's weights, FLOPs and inner activations
    by tp at the cost of two all-reduces per block in forward and two in
    backward. Runs when `parallel.tp` > 1. Raises CompileError, naming the
    module and node and the shard rule that would fix it, for a structure it
    cannot split.
    """
    plan = decisions.plan
    tp = plan.parallel.tp
    if tp == 1:
        return gm
    if graph_record(gm).tensor_parallel is not None:
        raise CompileError("tensor_parallel: the graph is already split over tp")
    to_linear_form(gm)
    to_cat_form(gm)  # keys filled in place (DeepSeek's MLA): a cat the trace can follow
    sharding = find_sharding(gm, plan)
    for path, style in sharding.styles.items():
        log.debug("%s: %s (%s)", path, style, sharding.why[path])
    rewrite = _Rewrite(gm, sharding, tp)
    layout = rewrite.shard_params()
    rewrite.insert_collectives()
    propagation = propagate(gm, k=tp, prefer=sharding.heads, padded=rewrite.padded,
                            on_mix=rewrite.take_part, axes={"cp": plan.parallel.cp},
                            advice=_keep_whole_rule)
    region = _check_region(gm, rewrite, propagation)
    partial = _partial_params(gm, region | _whole_in_region(gm, region, rewrite.parts), layout)
    layout = dataclasses.replace(layout, partial_grads=partial)
    update_graph_record(gm, tensor_parallel=layout)
    gm.graph.lint()
    gm.recompile()
    styles = list(sharding.styles.values())
    log.info("inserted %d copy_to_tp, %d reduce_from_tp; split %d linears colwise, %d rowwise, "
             "%d vocab-parallel (%s)", rewrite.counts["copy_to_tp"],
             rewrite.counts["reduce_from_tp"], styles.count(COLWISE), styles.count(ROWWISE),
             styles.count(VOCAB),
             ", ".join(p for p, s in sharding.styles.items() if s == VOCAB) or "none")
    return gm


class _Rewrite:
    """The graph surgery of the pass; remembers what it made for the checks after it."""

    def __init__(self, gm: fx.GraphModule, sharding: Sharding, tp: int):
        self.gm, self.sharding, self.tp = gm, sharding, tp
        self.order = list(gm.graph.nodes)
        self.colwise = sharding.nodes_of(gm, COLWISE)
        # Key/value projections kept whole (fewer kv heads than tp): inside the tp region,
        # their heads taken where they meet the split queries (`take_part`).
        self.kv_whole = [n for n in gm.graph.nodes if is_linear(n) in sharding.kv_replicated]
        self.parts: list[fx.Node] = []  # the tp_part nodes `take_part` made
        self.rowwise = sharding.nodes_of(gm, ROWWISE)
        vocab = sharding.nodes_of(gm, VOCAB)
        heads = {path for path in sharding.loss_heads.values()
                 if sharding.styles.get(path) == VOCAB}  # a rule may have kept one whole
        self.losses = [loss for loss, head in sharding.loss_heads.items() if head in heads]
        self.heads = [n for n in vocab if is_linear(n) in heads]
        self.embeddings = [n for n in vocab if n not in self.heads]
        self.counts = {"copy_to_tp": 0, "reduce_from_tp": 0}
        self.padded: dict[int, int] = {}  # a padded vocabulary's size -> its rows per rank
        self.starts: list[fx.Node] = []  # nodes whose output is split
        self.stops: set[fx.Node] = set()  # nodes that consume split inputs
        for node in vocab:
            if node not in self.heads and not _is_embedding_call(gm, node):
                raise CompileError(f"tensor parallelism: {where(node)} is marked vocab-parallel, "
                                   "but only token embeddings and the linear whose logits reach "
                                   "the cross-entropy can be")

    # ------------------------------------------------------------ parameters

    def shard_params(self) -> TensorParallelLayout:
        """Decide every split parameter's ParamShard and give it its local shape."""
        specs: dict[str, ParamShard] = {}

        def add(name: str | None, style: str, dim: int, segments: tuple[int, ...]) -> None:
            if name is None:
                return
            shape = tuple(self.gm.get_parameter(name).shape)
            # A vocabulary not divisible by tp is padded with rows no token reaches, as
            # Megatron-LM does; the loss masks their logits (`vocab_size`).
            pad = -segments[0] % self.tp if style == VOCAB else 0
            segments = (segments[0] + pad,) if pad else segments
            spec = ParamShard(style=style, dim=dim, segments=segments, full_shape=shape,
                              pad=pad)
            if specs.get(name, spec) != spec:
                raise CompileError(f"tensor parallelism: parameter {name} would be split two "
                                   f"ways ({specs[name]} and {spec}); make the modules that share "
                                   "it agree with shard rules")
            bad = [s for s in segments if s % self.tp]
            if bad:
                raise CompileError(f"tensor parallelism: {name} {shape} cannot be split "
                                   f"{self.tp} ways along dim {dim}: its pieces {list(segments)} "
                                   f"are not all divisible by tp = {self.tp}")
            specs[name] = spec

        for node in self.colwise + self.heads:
            weight, bias, out_dim = _linear_params(self.gm, node)
            rows = self.gm.get_parameter(weight).shape[out_dim]
            segments = (rows,) if node in self.heads else \
                _segments(node, rows, self.sharding.heads, self.tp)
            style = VOCAB if node in self.heads else COLWISE
            add(weight, style, out_dim, segments)
            add(bias, style, 0, segments)
        for node in self.rowwise:
            weight, _, _ = _linear_params(self.gm, node)
            in_dim = 1 if node.op == "call_module" else linear_in_dim(node)
            add(weight, ROWWISE, in_dim, (self.gm.get_parameter(weight).shape[in_dim],))
        for node in self.embeddings:
            weight = _embedding_weight(self.gm, node)
            add(weight, VOCAB, 0, (self.gm.get_parameter(weight).shape[0],))
        self.padded = {spec.full_shape[spec.dim]: spec.local_shape(self.tp)[spec.dim]
                       for spec in specs.values() if spec.pad}
        aliases = param_aliases(self.gm)
        self._check_whole_uses({a for name in specs for a in aliases[name]})
        out = {}
        for name, spec in specs.items():
            set_local_param(self.gm, aliases[name], spec.local_shape(self.tp))
            out.update({alias: spec for alias in aliases[name]})
        return TensorParallelLayout(tp=self.tp, params=out)

    def _check_whole_uses(self, split: set[str]) -> None:
        """A split parameter must not also be read whole (a tied weight kept replicated)."""
        sharded = set(self.colwise + self.heads + self.rowwise + self.embeddings)
        for node in self.gm.graph.nodes:
            if node in sharded:
                continue
            if node.op == "call_module":
                names = [f"{node.target}.{n}" for n, _ in
                         self.gm.get_submodule(str(node.target)).named_parameters()]
                readers = [node]
            elif node.op == "get_attr":
                names = [str(node.target)]
                readers = _whole_readers(node, sharded)
            else:
                continue
            for name in names:
                if name in split and readers:
                    raise CompileError(
                        f"tensor parallelism: parameter {name} is split over tp, but "
                        f"{where(readers[0])} reads it whole (a weight tied between a split and "
                        "a replicated module); give both modules the same shard rule")

    # ----------------------------------------------------------- collectives

    def insert_collectives(self) -> None:
        """copy_to_tp before column-parallel inputs, reduce_from_tp after row-parallel outputs."""
        for node in self.embeddings:
            self._embedding(node)
        copies: dict[fx.Node, fx.Node] = {}
        for node in sorted(self.colwise + self.heads + self.kv_whole, key=self.order.index):
            x = _linear_input(node)
            if x not in copies:
                copies[x] = self._collective(node, copy_to_tp, (x,), before=True)
            node.replace_input_with(x, copies[x])
            if node not in self.kv_whole:
                self.starts.append(node)
        for shared in self.sharding.shared_heads:
            self._shared_head(shared)
        self.rowwise = [self._rowwise(node) for node in self.rowwise]
        self.stops.update(self.rowwise)
        for loss in self.losses:
            self.stops.add(self._cross_entropy(loss))

    def _shared_head(self, shared: SharedHead) -> None:
        """copy_to_tp after each value a one-head broadcast is computed from (its readers
        read the copy), and the broadcast to the rank's own heads: Megatron-Core's MLA
        expands its rotary key k_pe to the heads of its partition."""
        for entry in shared.entries:
            copy = self._collective(entry, copy_to_tp, (entry,), before=False)
            for user in [u for u in entry.users if u in shared.readers]:
                user.replace_input_with(entry, copy)
        sizes, write = shape_slot(shared.expand)
        heads = len(sizes) - 3
        # A size traced off a tensor (fx's k.shape[1]) reads the rank's heads by itself.
        if isinstance(sizes[heads], int):
            sizes[heads] //= self.tp
            write(sizes)
        self.starts.append(shared.expand)

    def take_part(self, user: fx.Node, whole: fx.Node, dim: int) -> fx.Node:
        """This rank's part of `whole` along `dim`, where `user` pairs it with a split tensor
        (`local_shapes.propagate`'s on_mix): the key/value heads its query heads read.

        A tensor computed inside the tp region (after a `copy_to_tp`) or from parameters
        alone becomes `tp_part`, whose zero-padded gradient that copy (or the partial
        gradients of those parameters) sums; one computed from whole activations becomes
        `enter_tp_part`, which sums its gradient itself.
        """
        size = get_info(whole).shapes[0][dim]
        parts = self.tp if size % self.tp == 0 else size if self.tp % size == 0 else None
        entered = _entered_through(whole)
        if parts is None or len(entered) > 1:
            why = (f"its {size} pieces along dim {dim} cannot be shared evenly by tp = {self.tp}"
                   if parts is None else "it is computed both from inside a tp region and "
                   "from whole activations")
            raise CompileError(f"tensor parallelism: {where(user)} pairs a tensor split over tp "
                               f"with the whole tensor {whole.name}, and {why}; mark the linears "
                               "that make them replicate")
        op = enter_tp_part if entered == {"whole"} else tp_part
        with self.gm.graph.inserting_before(user):
            node = self.gm.graph.call_function(op, (whole, dim, parts, self.tp))
        copy_meta(whole, node, kind="other", **_FREE)
        self.starts.append(node)
        if op is tp_part:
            self.parts.append(node)
        return node

    def _collective(self, src: fx.Node, op, args: tuple, *, before: bool) -> fx.Node:
        where_ = self.gm.graph.inserting_before(src) if before else self.gm.graph.inserting_after(src)
        with where_:
            node = self.gm.graph.call_function(op, args)
        # The op keeps its input's shape (before any split: propagation splits it).
        shaped = get_info(args[0])
        copy_meta(src, node, kind="other", shapes=shaped.shapes, dtypes=shaped.dtypes, **_FREE)
        self.counts[op.__name__] = self.counts.get(op.__name__, 0) + 1
        return node

    def _rowwise(self, node: fx.Node) -> fx.Node:
        """Linear without bias -> reduce_from_tp -> + bias; returns the linear."""
        node = functionalize(self.gm, node)
        if op_name(node) in GROUPED_MM_OPS:  # the experts' down stack
            if (node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")) is not None:
                raise CompileError(f"tensor parallelism: {where(node)} adds a bias inside a "
                                   "row-parallel grouped product, which would be summed tp "
                                   "times; mark it replicate")
            users = list(node.users)
            reduced = self._collective(node, reduce_from_tp, (node,), before=False)
            for user in users:
                user.replace_input_with(node, reduced)
            return node
        if op_name(node) != "linear":
            raise CompileError(f"tensor parallelism: {where(node)} is a row-parallel linear "
                               "written as a matmul the pass cannot split (use nn.Linear or "
                               "F.linear, or mark it replicate)")
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if bias is not None:
            node.args = (*node.args[:2], None, *node.args[3:])
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "bias"}
        users = list(node.users)
        reduced = self._collective(node, reduce_from_tp, (node,), before=False)
        out = reduced
        if bias is not None:
            with self.gm.graph.inserting_after(reduced):
                out = self.gm.graph.call_function(operator.add, (reduced, bias))
            copy_meta(node, out, kind="pointwise", **_FREE)
        for user in users:
            user.replace_input_with(node, out)
        return node

    def _embedding(self, node: fx.Node) -> None:
        """Embedding -> vocab_parallel_embedding -> reduce_from_tp."""
        node = functionalize(self.gm, node)
        aten = isinstance(node.target, torch._ops.OpOverload)
        weight, index = (node.args[0], node.args[1]) if aten else (node.args[1], node.args[0])
        names = (("padding_idx", "scale_grad_by_freq", "sparse") if aten else
                 ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"))
        options = dict(zip(names, node.args[2:])) | dict(node.kwargs)
        padding = options.pop("padding_idx", None)
        padding = None if padding is None or (aten and padding == -1) else int(padding)
        if any(v not in (None, False, 2.0) for v in options.values()) or (
                padding is not None and padding < 0):
            raise CompileError(f"tensor parallelism: {where(node)} uses max_norm, "
                               "scale_grad_by_freq, sparse or a negative padding_idx, which the "
                               "vocabulary-parallel embedding does not support; mark it replicate")
        with self.gm.graph.inserting_before(node):
            lookup = self.gm.graph.call_function(vocab_parallel_embedding, (index, weight),
                                                 {"padding_idx": padding})
        copy_meta(node, lookup)
        reduced = self._collective(lookup, reduce_from_tp, (lookup,), before=False)
        node.replace_all_uses_with(reduced)
        name = node.name
        self.gm.graph.erase_node(node)
        lookup.name = name

    def _cross_entropy(self, loss: fx.Node) -> fx.Node:
        """F.cross_entropy / aten.cross_entropy_loss -> vocab_parallel_cross_entropy."""
        if isinstance(loss.target, torch._ops.OpOverload):
            args = dict(zip(("input", "target", "weight", "reduction", "ignore_index",
                             "label_smoothing"), loss.args)) | dict(loss.kwargs)
            reduction = _ATEN_REDUCTIONS[args.get("reduction", 1)]
        else:
            args = _CE_SIGNATURE.bind(*loss.args, **loss.kwargs).arguments
            reduction = args.get("reduction", "mean")
            if args.get("size_average") is not None or args.get("reduce") is not None:
                raise CompileError(f"tensor parallelism: {where(loss)} uses the deprecated "
                                   "size_average/reduce arguments")
        if args.get("weight") is not None or args.get("label_smoothing", 0.0):
            raise CompileError(f"tensor parallelism: {where(loss)} uses class weights or label "
                               "smoothing, which the vocabulary-parallel cross-entropy does not "
                               "support; mark the LM head replicate")
        with self.gm.graph.inserting_before(loss):
            options = {"ignore_index": args.get("ignore_index", -100), "reduction": reduction}
            if self.padded:  # the logits of padding rows are left out of the softmax
                options["vocab_size"] = next(iter(self.padded))
            new = self.gm.graph.call_function(vocab_parallel_cross_entropy, (
                args["input"], args["target"]), options)
        copy_meta(loss, new)
        loss.replace_all_uses_with(new)
        name = loss.name
        self.gm.graph.erase_node(loss)
        new.name = name
        return new


# ---------------------------------------------------------------- helpers


def _is_embedding_call(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), nn.Embedding)
    return op_name(node) == "embedding"


def _linear_params(gm: fx.GraphModule, node: fx.Node) -> tuple[str, str | None, int]:
    """(weight name, bias name or None, the weight's output-features dim) of a linear node."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        bias = f"{node.target}.bias" if module.bias is not None else None
        return f"{node.target}.weight", bias, 0
    out_dim = linear_out_dim(node)
    if op_name(node) in GROUPED_MM_OPS and out_dim is not None:
        return linear_weight(node), None, out_dim
    if op_name(node) != "linear" or out_dim is None:
        raise CompileError(f"tensor parallelism: {where(node)} is a linear written as "
                           f"{op_name(node)} of a reshaped weight, which the pass cannot split "
                           "(use nn.Linear or F.linear, or mark it replicate)")
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return linear_weight(node), param_source(bias) if bias is not None else None, out_dim


def _linear_input(node: fx.Node) -> fx.Node:
    return node.args[0] if node.args else node.kwargs["input"]


def _embedding_weight(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        return f"{node.target}.weight"
    aten = isinstance(node.target, torch._ops.OpOverload)
    return param_source(node.args[0] if aten else node.args[1])


def _segments(node: fx.Node, rows: int, heads: frozenset[int], tp: int) -> tuple[int, ...]:
    """The pieces of a column-parallel linear's output features, from how its output is cut.

    A split of the last dim (a fused q/k/v projection) gives its sizes, a
    chunk equal pieces, a reshape [.., F] -> [.., X1, .., Xm] as many pieces
    as the dims outside the heads dim hold; anything else one piece.
    """
    shape = get_info(node).shapes[0]
    sliced = _slice_segments(node, rows)
    if sliced is not None:
        return sliced
    for user in _decomposers(node):
        name = op_name(user)
        if name in ("split", "split_with_sizes", "chunk"):
            dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
            if dim % len(shape) != len(shape) - 1:
                continue
            sizes = user.args[1] if len(user.args) > 1 else \
                user.kwargs.get("split_size_or_sections", user.kwargs.get("chunks"))
            if name == "chunk":
                return (rows // sizes,) * sizes
            return (sizes,) * (rows // sizes) if isinstance(sizes, int) else tuple(sizes)
        if name in ("view", "reshape"):
            out = get_info(user).shapes[0]
            lead = len(shape) - 1
            if out[:lead] != shape[:lead] or len(out) <= len(shape):
                continue
            inner = out[lead:]
            picks = [j for j, x in enumerate(inner) if x in heads and x % tp == 0] or \
                [j for j, x in enumerate(inner) if x % tp == 0]
            if picks:
                outer = math.prod(inner[:picks[0]])
                return (rows // outer,) * outer
    return (rows,)


def _slice_segments(node: fx.Node, rows: int) -> tuple[int, ...] | None:
    """The pieces slices of the last dim cut a fused projection's output into (Phi-3's
    qkv[..., :q], qkv[..., q:q + kv], ...), or None when it is not sliced."""
    cuts = {0, rows}
    for user in _decomposers(node):
        if op_name(user) != "slice":
            continue
        args = list(user.args) + [None] * (5 - len(user.args))
        ndim = len(get_info(node).shapes[0])
        if (0 if args[1] is None else args[1]) % ndim != ndim - 1:
            continue
        for bound in args[2:4]:
            if isinstance(bound, int):
                cuts.add(min(max(bound + rows if bound < 0 else bound, 0), rows))
    if len(cuts) == 2:
        return None
    ordered = sorted(cuts)
    return tuple(b - a for a, b in zip(ordered, ordered[1:]))


def _decomposers(node: fx.Node) -> list[fx.Node]:
    """Users of a linear's output, through dtype casts and copies, in graph order."""
    out, todo = [], list(node.users)
    while todo:
        user = todo.pop(0)
        if op_name(user) in ("to", "float", "half", "bfloat16", "contiguous", "clone", "type_as"):
            todo.extend(user.users)
        else:
            out.append(user)
    return out


def _whole_readers(node: fx.Node, sharded: set[fx.Node]) -> list[fx.Node]:
    """Nodes that read `node`'s value other than split linears, through views and casts of it."""
    out = []
    for user in node.users:
        if user in sharded or is_shape_only(user):
            continue
        if op_name(user) in TRANSPARENT_OPS:
            out += _whole_readers(user, sharded)
        else:
            out.append(user)
    return out


# ------------------------------------------------------------------ checks


def _keep_whole_rule(node: fx.Node) -> str:
    """The shard rule that keeps whole the linears of the innermost module around `node`
    that has any (its layers' too): StableLM's per-head q norm names its attention."""
    info = get_info(node)
    if info is None or not info.module_path:
        return ""
    linear_paths = [meta.module_path for n in node.graph.nodes
                    if (meta := get_info(n)) is not None and meta.kind == "linear"]
    path = info.module_path
    while "." in path and not any(p.startswith(path + ".") for p in linear_paths):
        path = path.rpartition(".")[0]
    return (f"; to keep module {path!r} whole add to the parallel section: "
            f"shard \"{layer_glob(path)}.*\" replicate")


def _check_region(gm: fx.GraphModule, rewrite: _Rewrite, prop: Propagation) -> set[fx.Node]:
    """Split tensors stay split until a row-parallel linear or the loss consumes them;
    returns the nodes between (the split region)."""
    def onward(node: fx.Node) -> list[fx.Node]:
        if any(user.op == "output" for user in node.users):
            raise CompileError(f"tensor parallelism: the split output of {where(node)} "
                               "reaches the graph's output without being reduced")
        return [u for u in node.users if u not in rewrite.stops and not is_shape_only(u)]

    region = set(walk(rewrite.starts, onward))
    for node in (n for n in gm.graph.nodes if n in region):  # graph order: the first is named
        if prop.is_split(node):
            _check_reduction(node, prop)
        elif not all(is_shape_only(u) for u in node.users):
            raise CompileError(
                f"tensor parallelism: {where(node)} turns a tensor split over tp into one "
                f"that is not ({prop.before[node]} -> {prop.local[node]}): it reduces over or "
                "indexes the split dimension; mark the linears around it replicate")
    weights: set[fx.Node] = set()  # parameters and their views: split with the parameter
    for node in gm.graph.nodes:
        if node.op == "get_attr" or (node.all_input_nodes and
                                     all(a in weights for a in node.all_input_nodes)):
            weights.add(node)
        elif node not in region and prop.is_split(node):
            raise CompileError(f"tensor parallelism: {where(node)} changed shape "
                               f"{prop.before[node]} -> {prop.local[node]} outside a split region")
    return region


def _entered_through(node: fx.Node) -> set[str]:
    """How the activations `node` is computed from reach it: {"tp"} through copy_to_tp
    only, {"whole"} around it (from the inputs, or a region's reduce_from_tp), both, or
    neither (parameters and buffers alone)."""
    ways, seen, todo = set(), set(), [node]
    while todo:
        n = todo.pop()
        if n in seen or is_shape_only(n):  # a size read off an activation carries no data
            continue
        seen.add(n)
        if n.target is copy_to_tp:
            ways.add("tp")
        elif n.op == "placeholder" or n.target is reduce_from_tp:  # a region's sum is whole
            ways.add("whole")
        else:
            todo.extend(n.all_input_nodes)
    return ways


def _whole_in_region(gm: fx.GraphModule, region: set[fx.Node],
                     parts: list[fx.Node]) -> set[fx.Node]:
    """Whole tensors whose gradient each tp rank has only its part of: what a tp region
    computes before it splits (its copy_to_tp, key/value projections kept whole, RoPE on
    them), and what a `tp_part` takes from parameters alone (a bias table).

    Raises CompileError when one also reaches a node outside the region, whose gradient
    would be whole: summing it over tp would count that part tp times.
    """
    whole: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node not in region and not is_shape_only(node) and (
                node.target is copy_to_tp or any(a in whole for a in node.all_input_nodes)):
            whole.add(node)
    for node in whole:
        for user in node.users:
            if user not in region and user not in whole and not is_shape_only(user):
                raise CompileError(f"tensor parallelism: {where(node)} is computed whole in a "
                                   f"tp region and read outside it by {where(user)}; mark the "
                                   "linears around it replicate")
    todo = [p.args[0] for p in parts]
    while todo:  # parameters alone: no copy_to_tp or graph input behind them
        n = todo.pop()
        if n in whole or n.target is copy_to_tp or n.op == "placeholder" or is_shape_only(n) \
                or _entered_through(n):
            continue
        whole.add(n)
        todo.extend(n.all_input_nodes)
    return whole


def _partial_params(gm: fx.GraphModule, region: set[fx.Node],
                    layout: TensorParallelLayout) -> tuple[str, ...]:
    """Replicated parameters the split region reads (a per-head q/k norm's weight): each tp
    rank's gradient of them covers its own heads only, so the runtime sums them over tp.

    Raises CompileError for one also read outside the region, whose gradient would be
    partly whole and partly split.
    """
    behind = params_behind(gm)

    def read_by(node: fx.Node) -> list[str]:
        if node.op == "call_module":
            return [f"{node.target}.{name}" for name, _ in module_of(node).named_parameters()]
        return [name for arg in node.all_input_nodes for name in behind.get(arg, ())]

    inside: dict[str, fx.Node] = {}
    outside: set[str] = set()
    for node in gm.graph.nodes:
        if node in behind:  # computed from weights alone (1 + w): not a use on activations
            continue
        for name in read_by(node):
            if name in layout.params:
                continue
            if node in region:
                inside.setdefault(name, node)
            else:
                outside.add(name)
    for name, node in inside.items():
        if name in outside:
            raise CompileError(f"tensor parallelism: parameter {name} is read both on tensors "
                               f"split over tp ({where(node)}) and on whole ones; mark the "
                               "linears around it replicate")
    return tuple(inside)


def _check_reduction(node: fx.Node, prop: Propagation) -> None:
    """A norm or softmax in a split region must not reduce over the split dim."""
    meta = get_info(node)
    if meta is None or meta.kind not in ("norm", "softmax") or not node.all_input_nodes:
        return
    x = node.all_input_nodes[0]
    before, local = prop.before[x][0], prop.local[x][0]
    split = next((d for d in range(len(before)) if before[d] != local[d]), None)
    if split is None:
        return
    if meta.kind == "softmax":
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
        reduced = {dim % len(before)}
    else:
        if node.op == "call_module":
            shape = getattr(node.graph.owning_module.get_submodule(str(node.target)),
                            "normalized_shape", (before[-1],))
        else:
            shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
        # A shape read off the weight at run time (weight.shape) normalises the last dim.
        ndim = len(shape) if isinstance(shape, (tuple, list, torch.Size)) else 1
        reduced = set(range(len(before) - ndim, len(before)))
    if split in reduced:
        raise CompileError(f"tensor parallelism: {where(node)} normalises over the dimension "
                           "split over tp; mark the linears that feed it replicate")
