"""Find what tensor parallelism can split in a captured graph, from the graph alone.

No per-model tables: the structure is read off the dataflow.

- **Attention.** For every attention (fused SDPA or written-out
  matmul-softmax-matmul, `nodes.attention_parts`), the linears that q, k
  and v come from — through head reshapes, transposes, splits of a fused
  projection and RoPE's elementwise arithmetic — are column-parallel, split
  by heads; the linear its output reaches through a heads merge is
  row-parallel. Key/value heads fewer than tp (tp a multiple of them) are
  replicated: their projections stay whole, and each rank keeps the heads
  its own query heads read where k and v meet them (`Sharding.kv_replicated`).
- **Latent attention** (DeepSeek's MLA, as Megatron-Core splits it). A linear
  whose output only feeds an attention's head projections — through a norm or
  a split — is a low-rank down projection: replicated, each rank computes the
  whole latent and its column-parallel up projection splits it by heads. A key
  part of one head broadcast to every head (`expand`, the rotary key k_pe) is
  a shared head (`SharedHead`): computed whole and expanded to the rank's own
  heads.
- **MLP.** A linear whose input is computed only elementwise (activations,
  products, dropout, casts) from other linears' outputs is row-parallel and
  those linears are column-parallel (both gate and up of a SwiGLU).
- **Vocabulary.** An embedding looked up by the tokens, with as many rows as
  the logits have columns, is vocabulary-parallel; so is the linear whose
  output reaches the cross-entropy (the LM head), and the cross-entropy
  becomes vocabulary-parallel. A tied head and embedding share one shard.
- **Mixture of experts.** A stack of expert weights applied by a grouped
  product (`nodes.GROUPED_MM_OPS`) is a linear like any other: the experts'
  gate/up stack column-parallel, their down stack row-parallel, each
  expert's MLP split as an MLP. A linear whose scores reach a top-k (the
  router) is replicated.
- Everything else — norms, position embeddings — is replicated.

`parallel.shard` rules (fnmatch globs over module paths, the last matching
rule wins) override or complete this. A linear that is neither inferred
nor annotated is an error naming the module and the node, with the rule
that would fix it.

Terms: a *data* node is a tensor computed from the tokens (an activation),
as opposed to parameters, buffers and what is built from them alone.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from torch import fx

from ptc.compiler.graph.meta import get_info, graph_info
from ptc.compiler.graph.nodes import (CROSS_ENTROPY_OPS, DROPOUT_OPS, TRANSPARENT_OPS,
                                      attention_parts, is_embedding, is_linear, node_shape,
                                      op_name, picks_experts, walk)
from ptc.errors import CompileError
from ptc.plan import Plan, ShardRule

COLWISE, ROWWISE, VOCAB, REPLICATE = "colwise", "rowwise", "vocab", "replicate"

# Ops that carry heads between a q/k/v projection and the attention: reshapes,
# transposes, fused-projection splits, RoPE's rotate-half (or rotate-every-two: strided
# slices stacked back) and products with tables.
_HEAD_OPS = TRANSPARENT_OPS | DROPOUT_OPS | {
    "getitem", "split", "split_with_sizes", "chunk", "unbind", "cat", "concat", "stack", "narrow",
    "neg", "mul", "add", "sub", "repeat_interleave", "repeat", "unflatten", "movedim",
    "swapaxes", "view_as", "reshape_as", "slice", "select",
    # a per-head q/k norm (Qwen3, Gemma 3): its arithmetic; its reductions pass `_per_head`
    "pow", "rsqrt", "sqrt", "div", "truediv", "reciprocal",
    # clipping q, k and v to a bound (OLMo's clip_qkv), in place or not
    "clamp", "clamp_", "clip", "clip_"}
# Normalisations a trace may pass when they reduce only within one head (`_per_head`).
_HEAD_REDUCTIONS = frozenset({"mean", "var", "sum", "norm", "rms_norm", "layer_norm"})
# Ops between an MLP's projections: elementwise only.
_ELEMENTWISE_KINDS = frozenset({"activation", "pointwise", "dropout"})
# Ops from an attention's output to its output projection: the heads merge.
_MERGE_OPS = TRANSPARENT_OPS | DROPOUT_OPS | {"getitem"}


@dataclass(frozen=True)
class SharedHead:
    """One head broadcast to every head of an attention (`expand` of a size-1 heads dim):
    the rotary key that multi-head latent attention shares between its heads (DeepSeek's
    k_pe). Each tp rank expands it to its own heads only; what it is computed from stays
    whole on every rank and enters the tp region at `entries` (through `copy_to_tp`, so
    that the gradients of the ranks' heads are summed before they leave it)."""

    expand: fx.Node
    """The broadcast: its heads size becomes the rank's heads count."""
    projection: str
    """The linear the rest of those keys (or values) come from: the broadcast is split with
    it, and kept whole when a rule keeps it whole."""
    entries: tuple[fx.Node, ...]
    """The nodes whose values enter the tp region: the first ones computed for the broadcast
    alone (the shared piece split off a down projection's output), in graph order."""
    readers: frozenset[fx.Node]
    """The nodes that read the entries' values in the region, between them and the
    broadcast, the broadcast included."""


@dataclass
class Sharding:
    """How each linear and embedding is split, and the nodes the rewrite needs."""

    styles: dict[str, str] = field(default_factory=dict)
    """Module path -> "colwise", "rowwise", "vocab" or "replicate"."""
    why: dict[str, str] = field(default_factory=dict)
    """Module path -> what decided its style ("attention heads", "rule 'layers.*.mlp.up'")."""
    heads: frozenset[int] = frozenset()
    """Heads counts of the attentions (query and key/value): reshapes split these dims."""
    kv_projections: set[str] = field(default_factory=set)
    """The attentions' key/value projections (those not fused with the queries')."""
    kv_replicated: set[str] = field(default_factory=set)
    """Key/value projections kept whole because tp exceeds their heads: each rank computes
    them all and keeps the heads its queries read where they meet (`ops.tp_ops.tp_part`)."""
    loss_heads: dict[fx.Node, str] = field(default_factory=dict)
    """Cross-entropy node -> the module path of the linear its logits come from (the loss
    is vocabulary-parallel while that head's style is "vocab")."""
    shared_heads: list[SharedHead] = field(default_factory=list)
    """Parts of the attentions' keys or values that one head gives all heads."""

    def nodes_of(self, gm: fx.GraphModule, style: str) -> list[fx.Node]:
        """Linear / embedding nodes whose module has `style`, in graph order."""
        return [n for n in gm.graph.nodes if self.styles.get(_module(n)) == style]


def _module(node: fx.Node) -> str | None:
    return is_linear(node) or is_embedding(node)


def infer_sharding(gm: fx.GraphModule, rules: tuple[ShardRule, ...] = ()) -> Sharding:
    """The split the graph's structure implies, overridden by `rules` where they match (a
    plan's `shard` rules); linears it cannot place are left out. What the memory and cost
    profiles read (`ptc.compiler.profile`): a linear a rule keeps whole is held and
    computed whole on every rank there, as in the lowered graph."""
    found = _Finder(gm, 1).infer()
    _override(gm, found, rules, {})
    return found


def find_sharding(gm: fx.GraphModule, plan: Plan) -> Sharding:
    """Infer the split of every linear and embedding of `gm`, then apply the plan's rules."""
    finder = _Finder(gm, plan.parallel.tp)
    found = finder.infer()
    _apply_rules(gm, found, plan, finder.failures)
    return found


class _Finder:
    def __init__(self, gm: fx.GraphModule, tp: int):
        self.gm, self.tp = gm, tp
        self.linears = {n: p for n in gm.graph.nodes if (p := is_linear(n))}
        self.embeddings = {n: p for n in gm.graph.nodes if (p := is_embedding(n))}
        self.data = _data_nodes(gm)
        self.broadcasts = [n for n in gm.graph.nodes
                           if n in self.data and _broadcasts_one_head(n)]
        self.order = _order(gm)  # the finder only reads the graph: one index for every sort
        self.failures: dict[str, str] = {}  # linear path -> why it could not be split
        self.blocker: fx.Node | None = None  # the op the last failed trace stopped at

    def infer(self) -> Sharding:
        found = Sharding()
        self._vocab(found)
        self._attention(found)
        self._mlp(found)
        for path in self.embeddings.values():
            found.styles.setdefault(path, REPLICATE)
            found.why.setdefault(path, "not indexed by the tokens")
        return found

    # ------------------------------------------------------------ vocabulary

    def _vocab(self, found: Sharding) -> None:
        vocab = graph_info(self.gm).vocab
        tokens = next((n for n in self.gm.graph.nodes if n.op == "placeholder"), None)
        for node, path in self.embeddings.items():
            if _back_to(_embedding_index(node), tokens) and _table_rows(self.gm, node) == vocab:
                found.styles[path], found.why[path] = VOCAB, "embedding of the tokens"
        for node in self.gm.graph.nodes:
            if op_name(node) not in CROSS_ENTROPY_OPS:
                continue
            head = self._trace_back(node.args[0], _MERGE_OPS, stop=self.linears,
                                    also=self._per_logit)
            if len(head) == 1:
                path = self.linears[head[0]]
                found.styles[path], found.why[path] = VOCAB, "LM head (its logits reach the loss)"
                found.loss_heads[node] = path

    def _elementwise_alone(self, node: fx.Node) -> bool:
        """Whether `node` is elementwise on one activation: its other operands are
        parameters, buffers or constants."""
        meta = get_info(node)
        return meta is not None and meta.kind in ("pointwise", "activation") and \
            sum(a in self.data for a in node.all_input_nodes) == 1

    def _per_logit(self, node: fx.Node) -> bool:
        """Whether `node` transforms each logit by itself: an elementwise op whose other
        operands are scalars (Gemma 2's soft-capping: logits / c, tanh, * c)."""
        return self._elementwise_alone(node) and \
            all(a not in self.data and not node_shape(a) for a in node.all_input_nodes[1:])

    # ------------------------------------------------------------- attention

    def _attention(self, found: Sharding) -> None:
        heads = set()
        for node in self.gm.graph.nodes:
            parts = attention_parts(node)
            if parts is None:
                continue
            heads.update(shape[-3] for shape in map(node_shape, (parts.q, parts.k, parts.v))
                         if shape is not None and len(shape) >= 3)
            traced = self._head_sources(node, parts)
            out = self._trace_forward(node, _MERGE_OPS)
            if traced is None or out is None:
                continue
            sources, shared = traced
            if parts.sinks is not None:
                self._fail_all([*sources, out], "its attention joins per-head sink logits to "
                               "the scores (attention sinks), which tensor parallelism does "
                               "not split by heads")
                continue
            kv_heads = self._kv_heads(parts, sources)
            uneven = self._uneven_heads(parts, sources, kv_heads)
            if uneven:
                self._fail_all([*sources, out], uneven)
                continue
            for role, src in zip("qkv", sources):
                path = self.linears[src]
                if role != "q" and src is not sources[0]:
                    found.kv_projections.add(path)
                if role != "q" and kv_heads % self.tp:  # fewer kv heads than ranks: whole
                    found.styles[path] = REPLICATE
                    found.why[path] = (f"attention {role} ({kv_heads} key/value heads, fewer "
                                       f"than tp = {self.tp}: replicated)")
                    found.kv_replicated.add(path)
                elif path not in found.kv_replicated:
                    found.styles[path] = COLWISE
                    found.why[path] = "attention q/k/v (split by heads)"
            path = self.linears[out]
            found.styles[path], found.why[path] = ROWWISE, "attention output projection"
            found.shared_heads.extend(self._shared_head(expand, self.linears[src])
                                      for expand, src in shared.items())
            self._down_projections(found, {*sources, *shared})
        found.heads = frozenset(heads)

    def _head_sources(self, attention: fx.Node,
                      parts) -> tuple[list[fx.Node], dict[fx.Node, fx.Node]] | None:
        """The one linear each of q, k and v comes from through ops that keep heads apart,
        and the one-head broadcasts (`SharedHead`) the keys or values also take a part from,
        each with the linear of its role; None, with the failure recorded for the linears
        involved, when they do not."""
        q = node_shape(parts.q)
        stop = self.linears | {b: "" for b in self.broadcasts
                               if q is not None and _broadcast_to(b, q)}
        sources, shared = [], {}
        for role, operand in (("q", parts.q), ("k", parts.k), ("v", parts.v)):
            reached = self._trace_back(operand, _HEAD_OPS, stop=stop,
                                       also=lambda n: _per_head(n, (q or (None,))[-1]))
            linears = [n for n in reached if n in self.linears]
            if len(linears) != 1:
                why = self._why_not_heads(role, attention, reached)
                whole = [lin for x in (parts.q, parts.k, parts.v) for lin in self._trace_back(
                    x, frozenset(), stop=self.linears, also=lambda n: True)]
                self._fail_all(whole + [self._trace_forward(attention, _MERGE_OPS)], why)
                return None
            sources.append(linears[0])
            shared.update((n, linears[0]) for n in reached if n not in self.linears)
        return sources, shared

    def _shared_head(self, expand: fx.Node, projection: str) -> SharedHead:
        """The broadcast `expand` with what enters the tp region on its way: the values that
        the nodes computed for it alone read from elsewhere (a piece of a split is taken
        whole: its getitem enters, not the split)."""
        readers = self._feeders({expand}) | {expand}
        entries = {n if op_name(n) == "getitem" else a for n in readers
                   for a in n.all_input_nodes if a in self.data and a not in readers}
        return SharedHead(expand=expand, projection=projection,
                          entries=tuple(sorted(entries, key=self.order)),
                          readers=frozenset(readers))

    def _down_projections(self, found: Sharding, targets: set[fx.Node]) -> None:
        """Replicate the linears computed only for an attention's head projections and shared
        heads (`targets`): the low-rank down projections of multi-head latent attention, whose
        latent every rank computes whole (as Megatron-Core's MLA does)."""
        for node in sorted(self._feeders(targets) & self.linears.keys(), key=self.order):
            path = self.linears[node]
            if path not in found.styles:
                found.styles[path] = REPLICATE
                found.why[path] = "low-rank projection into an attention's heads (replicated)"

    def _feeders(self, targets: set[fx.Node]) -> set[fx.Node]:
        """The data nodes computed for `targets` alone (every use of each leads to one of
        them), back from the targets' inputs to the linears that begin them, included."""
        inside, queued, heap = set(targets), set(), []

        def queue_inputs(node: fx.Node) -> None:
            for a in node.all_input_nodes:
                if a in self.data and a not in queued:
                    queued.add(a)
                    heapq.heappush(heap, (-self.order(a), a))

        for target in targets:
            queue_inputs(target)
        while heap:  # latest first: a node's users are decided before it
            _, node = heapq.heappop(heap)
            if node in inside or not all(u in inside for u in node.users if u in self.data):
                continue
            inside.add(node)
            if node not in self.linears:
                queue_inputs(node)
        return inside - targets

    def _why_not_heads(self, role: str, attention: fx.Node, reached: list[fx.Node]) -> str:
        if reached:
            return f"the attention's {role} ({_where(attention)}) does not come from one linear"
        what = ("a norm over the whole projection, not one head"
                if op_name(self.blocker) in _HEAD_REDUCTIONS else "not an op known to keep heads apart")
        return (f"the attention's {role} ({_where(attention)}) comes from it through "
                f"{op_name(self.blocker)} ({_where(self.blocker)}), which mixes the heads "
                f"({what})")

    def _kv_heads(self, parts, sources: list[fx.Node]) -> int:
        """Key/value heads of an attention, from its k projection's features (the attention
        may see them repeated to the query heads); a fused qkv holds them besides q's, a
        fused kv (MLA's up projection) says them by the heads its output is viewed as."""
        q, k = node_shape(parts.q), node_shape(parts.k)
        heads, head_dim = q[-3], q[-1]
        if sources[1] is sources[2] is not sources[0]:
            return _viewed_heads(sources[1]) or k[-3]
        features = node_shape(sources[1])[-1]
        if sources[1] is sources[0]:
            features = (features - heads * head_dim) // 2
        return features // head_dim if features % head_dim == 0 and features else k[-3]

    def _uneven_heads(self, parts, sources: list[fx.Node], kv_heads: int) -> str | None:
        """Why the attention's heads cannot be split over tp, or None. Key/value heads that
        tp does not divide are replicated when they divide tp (separate k/v projections)."""
        heads = node_shape(parts.q)[-3]
        if heads % self.tp:
            return (f"its attention has {heads} query heads, not divisible by tp = {self.tp} "
                    "(choose a tp that divides the head count)")
        if kv_heads % self.tp == 0:
            return None
        if self.tp % kv_heads:
            return (f"its attention has {kv_heads} key/value heads and tp = {self.tp}: "
                    "neither divides the other, so the heads can be neither split nor "
                    "replicated evenly")
        if sources[1] is sources[0]:
            return (f"its attention has {kv_heads} key/value heads, fewer than tp = "
                    f"{self.tp}, in a projection fused with the queries; key/value heads are "
                    "replicated only from their own projections (choose a tp that divides "
                    f"{kv_heads})")
        return None

    # ------------------------------------------------------------------- mlp

    def _mlp(self, found: Sharding) -> None:
        for node, path in self.linears.items():
            if path in found.styles:
                continue
            x = node.args[0] if node.args else None
            sources, blocker = self._elementwise_sources(x)
            if blocker is not None or not sources:
                continue
            if any(found.styles.get(self.linears[s], COLWISE) != COLWISE for s in sources):
                continue
            for src in sources:
                p = self.linears[src]
                found.styles[p], found.why[p] = COLWISE, f"MLP input projection of {path}"
            found.styles[path], found.why[path] = ROWWISE, "MLP output projection"
        for node, path in self.linears.items():
            if path not in found.styles and picks_experts(node):
                found.styles[path], found.why[path] = REPLICATE, "MoE router (its scores pick experts)"
            elif path not in found.styles and (node_shape(node) or (0,))[-1] == 1:
                found.styles[path], found.why[path] = REPLICATE, "a scalar gate (one output feature)"
            elif path not in found.styles:
                self.failures.setdefault(path, self._why_not(node))

    def _elementwise_sources(self, x) -> tuple[list[fx.Node], fx.Node | None]:
        """Linears that `x` is computed from elementwise, and the first non-elementwise op."""
        sources, seen, todo = [], set(), [x]
        while todo:
            n = todo.pop()
            if not isinstance(n, fx.Node) or n in seen or n not in self.data:
                continue
            seen.add(n)
            if n in self.linears:
                sources.append(n)
                continue
            meta = get_info(n)
            kind = meta.kind if meta is not None else ""
            if kind not in _ELEMENTWISE_KINDS and op_name(n) not in TRANSPARENT_OPS \
                    and not _splits_features(n):
                return sources, n
            todo.extend(n.all_input_nodes)
        return sorted(sources, key=self.order), None

    def _why_not(self, node: fx.Node) -> str:
        for user in _data_users(node, self.data):
            if user in self.linears:
                continue
            meta = get_info(user)
            if meta is not None and meta.kind not in _ELEMENTWISE_KINDS \
                    and op_name(user) not in TRANSPARENT_OPS:
                return f"its output reaches {op_name(user)} ({_where(user)}), which is not elementwise"
        return "it is neither an attention's projection nor part of an MLP (linear -> elementwise -> linear)"

    def _fail_all(self, nodes: Iterable[fx.Node | None], why: str) -> None:
        for n in nodes:
            if n is not None:
                self.failures.setdefault(self.linears[n], why)

    # --------------------------------------------------------------- tracing

    def _trace_back(self, start, through: frozenset[str], stop: dict,
                    also=lambda node: False) -> list[fx.Node]:
        """Nodes of `stop` reached backwards from `start` through data nodes of `through` ops
        (or that `also` accepts)."""
        reached, seen, todo = [], set(), [start]
        while todo:
            n = todo.pop()
            if not isinstance(n, fx.Node) or n in seen or n not in self.data:
                continue
            seen.add(n)
            if n in stop:
                reached.append(n)
            elif _passes(n, through) or also(n):
                todo.extend(n.all_input_nodes)
            else:
                self.blocker = n
                return []
        return sorted(reached, key=self.order)

    def _trace_forward(self, start: fx.Node, through: frozenset[str]) -> fx.Node | None:
        """The one linear `start` reaches forwards through single-user ops of `through`."""
        n = start
        for _ in range(16):
            users = [u for u in n.users if u in self.data]
            if len(users) != 1:
                return None
            n = users[0]
            if n in self.linears:
                return n
            if not _passes(n, through):
                return None
        return None


def _passes(node: fx.Node, through: frozenset[str]) -> bool:
    """Whether a trace may go through `node`: one of the `through` ops, or a dropout module."""
    meta = get_info(node)
    if meta is not None and meta.kind == "dropout":
        return True
    return node.op in ("call_function", "call_method") and op_name(node) in through


def _splits_features(node: fx.Node) -> bool:
    """Whether `node` takes pieces of the last dim (a fused gate_up projection's chunk) or
    one of those pieces (getitem)."""
    name = op_name(node)
    if name == "getitem":
        return True
    if name not in ("chunk", "split", "split_with_sizes") or not node.args:
        return False
    shape = node_shape(node.args[0])
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    return shape is not None and isinstance(dim, int) and dim % len(shape) == len(shape) - 1


def _broadcasts_one_head(node: fx.Node) -> bool:
    """Whether `node` expands a size-1 dim third from the end ([.., 1, s, d] -> [.., h, s, d]):
    one head given to every head."""
    if op_name(node) != "expand" or not node.args:
        return False
    before, after = node_shape(node.args[0]), node_shape(node)
    return before is not None and after is not None and len(before) == len(after) >= 3 and \
        before[-3] == 1 < after[-3]


def _broadcast_to(node: fx.Node, q: tuple[int, ...]) -> bool:
    """Whether the one-head broadcast `node` gives its head to as many heads as the
    attention's queries `q` [.., heads, s, d] have, in the same layout."""
    shape = node_shape(node)
    return len(shape) == len(q) and shape[-3] == q[-3]


def _viewed_heads(projection: fx.Node) -> int | None:
    """The heads a projection's output is viewed as: dim -2 of a reshape of its features F
    into [.., heads, F / heads] (None when it has none)."""
    features = node_shape(projection)[-1]
    for user in projection.users:
        shape = node_shape(user)
        if op_name(user) in ("view", "reshape") and shape is not None and len(shape) >= 2 and \
                shape[-2] * shape[-1] == features and shape[-2] > 1:
            return shape[-2]
    return None


def _per_head(node: fx.Node, head_dim: int | None) -> bool:
    """Whether `node` normalises or reduces over the last dim only, one head's features
    (of size `head_dim`, behind a heads dim): a per-head norm, which splitting by heads keeps."""
    name = op_name(node)
    shape = node_shape(node.args[0]) if node.args else None
    if name not in _HEAD_REDUCTIONS or shape is None or len(shape) < 3 or shape[-1] != head_dim:
        return False
    if name in ("rms_norm", "layer_norm"):
        normalized = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
        return list(normalized or ()) == [head_dim]
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or ())
    return len(dims) == 1 and dims[0] % len(shape) == len(shape) - 1


def _data_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Tensor nodes computed from the graph's placeholders (activations, not weights)."""
    data: set[fx.Node] = set()
    for n in gm.graph.nodes:
        meta = get_info(n)
        is_tensor = meta is not None and bool(meta.shapes)
        if n.op == "placeholder" or (is_tensor and any(a in data for a in n.all_input_nodes)):
            data.add(n)
    return data


def _data_users(node: fx.Node, data: set[fx.Node]) -> list[fx.Node]:
    """Data nodes downstream of `node` through transparent ops, first non-transparent ones."""
    out, todo = [], list(node.users)
    while todo:
        n = todo.pop(0)
        if n not in data:
            continue
        if op_name(n) in TRANSPARENT_OPS | {"getitem", "split", "chunk"}:
            todo.extend(n.users)
        else:
            out.append(n)
    return out


def _embedding_index(node: fx.Node):
    if node.op == "call_module":
        return node.args[0]
    target = node.target
    # aten.embedding(weight, indices) vs F.embedding(input, weight)
    return node.args[1] if "aten" in str(getattr(target, "__module__", "")) or \
        "aten" in str(target) else node.args[0]


def _table_rows(gm: fx.GraphModule, node: fx.Node) -> int | None:
    """Rows of the table an embedding node reads."""
    if node.op == "call_module":
        return gm.get_submodule(str(node.target)).weight.shape[0]
    weight = node.args[0] if node.args[0] is not _embedding_index(node) else node.args[1]
    shape = node_shape(weight)
    return shape[0] if shape else None


def _back_to(node, target: fx.Node | None) -> bool:
    for _ in range(8):
        if node is target:
            return True
        if not isinstance(node, fx.Node) or op_name(node) not in TRANSPARENT_OPS or not node.args:
            return False
        node = node.args[0]
    return False


def _order(gm: fx.GraphModule):
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return index.__getitem__


def _where(node: fx.Node) -> str:
    meta = get_info(node)
    path = meta.module_path if meta is not None else ""
    return f"node {node.name}" + (f" in module {path!r}" if path else "")


def _layer_order(path: str) -> tuple:
    """Sort key putting layer 2 before layer 10."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("."))


def layer_glob(path: str) -> str:
    """The path with block indices as `*`: the rule that covers every layer."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


# ----------------------------------------------------------------- rules


def _apply_rules(gm: fx.GraphModule, found: Sharding, plan: Plan,
                 failures: dict[str, str]) -> None:
    """Override inferred styles with the plan's shard rules; fail on what stays unknown."""
    rules = plan.parallel.shards
    paths = {p for n in gm.graph.nodes if (p := _module(n))}
    used = _override(gm, found, rules, failures)
    unused = [r.pattern for r in rules if r.pattern not in used]
    if unused:
        raise CompileError(f"shard rules match no linear, embedding or norm: {unused}; "
                           f"modules are named like {sorted(paths)[:4]}")
    missing = {p: why for p, why in failures.items() if p not in found.styles}
    if missing:
        lines, by_rule = [], {}
        for path in sorted(missing, key=_layer_order):
            by_rule.setdefault(layer_glob(path), []).append(path)
        for rule, paths in by_rule.items():
            path = paths[0]
            node = next(n for n in gm.graph.nodes if is_linear(n) == path)
            more = f" (and {len(paths) - 1} more like it)" if len(paths) > 1 else ""
            lines.append(f"  linear {path!r} (node {node.name}){more}: {missing[path]}\n"
                         f"    to keep it whole add to the parallel section: "
                         f"shard \"{rule}\" replicate   (or colwise / rowwise)")
        raise CompileError("tensor parallelism cannot infer how to split:\n" + "\n".join(lines))


def rule_paths(gm: fx.GraphModule) -> set[str]:
    """The module paths a `shard` rule places: every linear and embedding, and every norm
    (which a rule can only keep whole)."""
    return {p for n in gm.graph.nodes if (p := _module(n))} | _norm_paths(gm)


def matching_rule(path: str, rules: tuple[ShardRule, ...]) -> ShardRule | None:
    """The rule that places the module at `path`: the last one whose glob matches it."""
    return next((r for r in reversed(rules) if fnmatchcase(path, r.pattern)), None)


def _norm_paths(gm: fx.GraphModule) -> set[str]:
    return {get_info(n).module_path for n in gm.graph.nodes
            if get_info(n) is not None and get_info(n).kind == "norm"}


def _override(gm: fx.GraphModule, found: Sharding, rules: tuple[ShardRule, ...],
              failures: dict[str, str]) -> set[str]:
    """Give each linear, embedding and norm the style of the last rule matching its path
    (a norm: replicate only); the patterns that matched. A path a rule places leaves
    `failures`; a shared head whose projection it keeps whole stays whole with it."""
    paths = {p for n in gm.graph.nodes if (p := _module(n))}
    embeddings = {p for n in gm.graph.nodes if (p := is_embedding(n))}
    heads = {p for p, s in found.styles.items() if s == VOCAB and p not in embeddings}
    others = _norm_paths(gm)
    used = set()
    for path in sorted(paths | others):
        rule = matching_rule(path, rules)
        if rule is None:
            continue
        used.add(rule.pattern)
        if path in others and path not in paths:
            if rule.style != REPLICATE:
                raise CompileError(f"shard rule \"{rule.pattern}\" {rule.style}: {path!r} is a "
                                   "norm; norms can only be replicated")
            continue
        allowed = (VOCAB, REPLICATE) if path in embeddings else \
            (COLWISE, ROWWISE, REPLICATE) + ((VOCAB,) if path in heads else ())
        if rule.style not in allowed:
            raise CompileError(f"shard rule \"{rule.pattern}\" {rule.style}: {path!r} can only "
                               f"be {' or '.join(allowed)}")
        # A column-parallel LM head is the vocabulary-parallel one (its loss follows it).
        style = VOCAB if path in heads and rule.style == COLWISE else rule.style
        found.styles[path], found.why[path] = style, f"rule \"{rule.pattern}\" {rule.style}"
        found.kv_replicated.discard(path)
        failures.pop(path, None)
    found.shared_heads = [shared for shared in found.shared_heads
                          if found.styles.get(shared.projection) == COLWISE]
    return used
