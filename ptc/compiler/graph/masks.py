"""What each attention lets a query see, read off its mask.

ptc trains next-token prediction: the logits at position t must come from
tokens 0..t alone, or the model learns to copy the token it is asked to
predict. In a captured transformer what mixes positions is attention, so
its mask decides. Capture refuses a model with an attention that lets a
query see a later key (`MaskReader.later_keys_seen`), and gives a fused
attention whose mask is exactly the causal one the causal kernel instead
(`MaskReader.only_causal`, `ptc.compiler.capture.causal_kernel`).

Terms: *hidden* is a bool tensor [..., queries, keys], True where the
attention gives the key no weight. A mask is *constant* when it is computed
from constants, real buffers and the shapes of other tensors alone (a
Hugging Face mask built from positions, `ones_like(scores).triu(1)`), so it
can be evaluated here, on the CPU, at the captured shape. An attention whose
mask reads the inputs' values or the weights is not judged (None).

Fused attention (scaled_dot_product_attention, any backend) hides what
`is_causal` and its mask hide: a bool mask keeps where True, a float mask
is added to the scores. Written-out attention (scores, then scaling,
masking, casts, then softmax) hides what its `masked_fill`s and added
masks hide.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
from torch import fx

from ptc.compiler.graph.meta import get_info
from ptc.compiler.graph.nodes import (CREATION_OPS, MATMUL_OPS, AttentionParts, attention_parts,
                                      data_operand, get_attr_value, node_shape, op_name)

_FUSED_ARGS = {
    "scaled_dot_product_attention": ((3, "attn_mask"), (5, "is_causal")),
    "site_attention": ((3, "attn_mask"), (5, "is_causal")),
    "scaled_dot_product_flash_attention_for_cpu": ((None, "attn_mask"), (4, "is_causal")),
    "scaled_dot_product_flash_attention": ((None, "attn_mask"), (4, "is_causal")),
    "scaled_dot_product_efficient_attention": ((3, "attn_bias"), (6, "is_causal")),
    "scaled_dot_product_cudnn_attention": ((3, "attn_bias"), (6, "is_causal")),
}
"""Fused attention ops: ((position, name) of the mask, (position, name) of is_causal)."""

_SHAPE_READS = frozenset({"size", "dim", "sym_size"}) | \
    {c for c in CREATION_OPS if c.endswith("_like") and c != "empty_like"}
"""Ops whose output depends on their first argument's shape, dtype and device only."""

_ATTRIBUTES = frozenset({"shape", "device", "dtype", "ndim"})

NO_BUFFERS: Mapping[str, torch.Tensor] = MappingProxyType({})

HIDDEN_BELOW = -1e4
"""An added score at or below this gets no weight after softmax (exp(-1e4) is 0 in every
float dtype): Hugging Face fills masks with the dtype's minimum, older code with -1e4."""

_MAX_ELEMENTS = 1 << 27
"""Masks larger than this (128 Mi elements) are not evaluated, to keep capture cheap."""


class MaskReader:
    """Reads the masks of one graph's attentions, evaluating each distinct mask once.

    `buffers`: the user's model's own buffers by name, read where the graph holds a buffer
    on the meta device (a causal mask kept as a buffer, as nanoGPT keeps it).
    """

    def __init__(self, buffers: Mapping[str, torch.Tensor] = NO_BUFFERS) -> None:
        self.buffers = buffers
        self._values: dict[tuple, object] = {}
        self._verdicts: dict[tuple, str | None] = {}

    def later_keys_seen(self, node: fx.Node) -> str | None:
        """Why the attention ending at `node` lets some query see a later key, or None when
        it does not, when `node` is no self-attention over one sequence, or when its mask
        cannot be evaluated."""
        parts = attention_parts(node)
        if parts is None or not _over_one_sequence(parts):
            return None
        masks = _fused_masks(node) if parts.fused else _written_masks(parts)
        if masks is None or masks == [_CAUSAL]:
            return None
        key = (_scores_size(parts), tuple((how, self._signature(m)) for how, m in masks))
        if key not in self._verdicts:
            self._verdicts[key] = self._judge(self._hidden(parts, masks))
        return self._verdicts[key]

    def hidden_keys(self, node: fx.Node) -> torch.Tensor | None:
        """The keys the attention ending at `node` hides from each query, as a bool tensor
        [..., queries, keys]; None when its mask is not constant."""
        parts = attention_parts(node)
        if parts is None:
            return None
        masks = _fused_masks(node) if parts.fused else _written_masks(parts)
        return None if masks is None else self._hidden(parts, masks)

    def only_causal(self, node: fx.Node) -> bool:
        """Whether the fused attention ending at `node` (is_causal not set) is given a
        constant mask that is exactly the causal one over one sequence: True (a bool mask)
        or 0 (a float mask) where the key is at or before the query, False or a hiding fill
        after it, the same for every sample and head. Such an attention is `is_causal`
        without the mask."""
        parts = attention_parts(node)
        if parts is None or not parts.fused or not _over_one_sequence(parts):
            return False
        masks = _fused_masks(node)
        if masks is None or len(masks) != 1 or masks[0][0] != "kept where true":
            return False
        value = self.constant_value(masks[0][1])
        size = _scores_size(parts)
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[-2:] != size:
            return False
        later = _later(size)
        if value.dtype == torch.bool:
            return bool((value == ~later).all())
        return bool(((value == 0) == ~later).all() and ((value <= HIDDEN_BELOW) == later).all())

    def constant_value(self, node) -> object | None:
        """The value `node` has at every call, evaluated on the CPU; None when it reads the
        inputs' values or a weight, or is too large to evaluate.

        Shape reads (`x.size(1)`, `x.device`, `ones_like(x)`) see a stand-in of x's shape
        and dtype, so a mask built from another tensor's shape is constant.
        """
        if not isinstance(node, fx.Node):
            return node
        key = self._signature(node)
        if key not in self._values:
            self._values[key] = self._evaluate_all(node)
        return self._values[key]

    # ---------------------------------------------------------------- inside

    def _hidden(self, parts, masks) -> torch.Tensor | None:
        size = _scores_size(parts)
        if size is None:
            return None
        hidden = torch.zeros(size, dtype=torch.bool)
        for how, mask in masks:
            value = _later(size) if how == "causal" else self._filled(mask) \
                if how == "filled" else self.constant_value(mask)
            if not isinstance(value, torch.Tensor):
                return None
            try:  # broadcast, as the attention broadcasts it
                hidden = hidden | _HIDES[how](value)
            except RuntimeError:
                return None
        return hidden if hidden.shape[-2:] == size else None

    def _filled(self, where: fx.Node) -> torch.Tensor | None:
        """Where `where(condition, a, b)` puts its fill in the scores' place (a bool tensor),
        when the fill hides a key (GPT-Neo's `where(causal, scores, min)`); None when the
        fill or the condition is not constant, or the fill does not hide."""
        scores = data_operand(where)
        condition, fill = where.args[0], (where.args[2] if scores is where.args[1]
                                          else where.args[1])
        condition, fill = self.constant_value(condition), self.constant_value(fill)
        if not isinstance(condition, torch.Tensor) or fill is None or \
                not bool((torch.as_tensor(fill) <= HIDDEN_BELOW).all()):
            return None
        return ~condition.bool() if scores is where.args[1] else condition.bool()

    @staticmethod
    def _judge(hidden: torch.Tensor | None) -> str | None:
        if hidden is None or bool((hidden | ~_later(hidden.shape[-2:])).all()):
            return None
        if not bool(hidden.any()):
            return "it hides no key from any query"
        return "its mask lets a query see a later key"

    def _signature(self, node) -> tuple:
        """What `node`'s value is computed from: its ancestors' ops and constants, in graph
        order, with shape reads as the shapes they read (equal for every layer's copy)."""
        if not isinstance(node, fx.Node):
            return ("constant", repr(node))
        chain = _ancestors(node)
        index = {n: i for i, n in enumerate(chain)}

        def ref(a):
            if a in index:
                return ("node", index[a])
            return ("shape", node_shape(a), tuple(get_info(a).dtypes) if get_info(a) else ())

        return tuple((n.op, str(n.target), repr(fx.node.map_arg(n.args, ref)),
                      repr(fx.node.map_arg(n.kwargs, ref))) for n in chain)

    def _evaluate_all(self, node: fx.Node) -> object | None:
        values: dict[fx.Node, object] = {}
        try:
            with torch.no_grad():
                for n in _ancestors(node):
                    values[n] = _evaluate(n, values, self.buffers)
        except _NotConstant:
            return None
        except Exception:  # noqa: BLE001 - a mask ptc cannot evaluate is not known
            return None
        return values[node]


# -------------------------------------------------------------- the masks

_CAUSAL = ("causal", None)
"""is_causal=True: every key after the query is hidden."""

_HIDES = {
    "causal": lambda later: later,
    "kept where true": lambda value: ~value if value.dtype == torch.bool
    else value <= HIDDEN_BELOW,
    "hidden where true": lambda value: value.bool(),
    "filled": lambda value: value,  # `MaskReader._filled`: already the keys hidden
    "added": lambda value: value <= HIDDEN_BELOW,
    "subtracted": lambda value: value >= -HIDDEN_BELOW,
}
"""How a mask hides keys, by how the attention applies it: bool tensor of hidden keys."""


def _fused_masks(node: fx.Node) -> list[tuple[str, object]] | None:
    """How is_causal and the mask of a fused attention hide keys: (how, mask) pairs."""
    (mask_at, mask_name), (causal_at, causal_name) = _FUSED_ARGS.get(
        op_name(node), ((None, ""), (None, "")))
    if not mask_name:
        return None
    mask = _arg(node, mask_at, mask_name)
    masks = [_CAUSAL] if _arg(node, causal_at, causal_name) else []
    if mask is not None:  # SDPA's: a bool mask keeps where True, a float one is added
        masks.append(("kept where true", mask))
    return masks


def _written_masks(parts: AttentionParts) -> list[tuple[str, object]] | None:
    """How the masked_fills, wheres and added masks between a written-out attention's
    score matmul and its softmax hide keys: (how, mask) pairs, a where as ("filled", the
    where node); None when a fill is not one that hides, or the way back to the score matmul
    leaves the scores' operand (`nodes.data_operand`)."""
    current, masks = parts.scores, []
    while op_name(current) not in MATMUL_OPS:
        name = op_name(current)
        if name in ("masked_fill", "masked_fill_"):
            if not _is_hiding(current.args[2]):
                return None
            masks.append(("hidden where true", current.args[1]))
        elif name in ("add", "add_", "sub") and isinstance(current.args[1], fx.Node):
            masks.append(("added" if name != "sub" else "subtracted", current.args[1]))
        elif name in ("where", "where_"):
            masks.append(("filled", current))
        following = data_operand(current) if current.args else None
        if not isinstance(following, fx.Node):
            return None
        current = following
    return masks


def _is_hiding(fill) -> bool:
    """Whether a masked_fill's fill value (a Python number) gives the key no weight."""
    return isinstance(fill, (int, float)) and fill <= HIDDEN_BELOW


def _later(size: tuple[int, int]) -> torch.Tensor:
    return torch.ones(size, dtype=torch.bool).triu(1)


def _scores_size(parts: AttentionParts) -> tuple[int, int] | None:
    """(queries, keys) of the attention, from the meta shapes of q and k."""
    q, k = node_shape(parts.q), node_shape(parts.k)
    if q is None or k is None or len(q) < 2 or len(k) < 2:
        return None
    keys = k[-2] if parts.fused else k[-1]  # written out: k is already transposed
    return torch.Size((q[-2], keys))


def _over_one_sequence(parts: AttentionParts) -> bool:
    """Whether queries and keys are the same number of positions (self-attention)."""
    size = _scores_size(parts)
    return size is not None and size[0] == size[1] and size[0] > 1


# -------------------------------------------------------------- evaluation


class _NotConstant(Exception):
    """The node reads an input's values or a weight."""


def _evaluate(node: fx.Node, values: dict[fx.Node, object], buffers) -> object:
    if node.op == "get_attr":
        value = get_attr_value(node)
        if isinstance(value, torch.Tensor) and value.is_meta:
            value = buffers.get(str(node.target), value)
        if isinstance(value, torch.Tensor) and (value.is_meta or value.requires_grad):
            raise _NotConstant
        return value
    if node.op not in ("call_function", "call_method"):
        raise _NotConstant
    if _reads_shape_only(node):
        values = dict(values) | {node.args[0]: _stand_in(node.args[0])}
    args = fx.node.map_aggregate(fx.node.map_arg(node.args, values.__getitem__), _on_cpu)
    kwargs = fx.node.map_aggregate(fx.node.map_arg(node.kwargs, values.__getitem__), _on_cpu)
    if node.op == "call_method":
        value = getattr(args[0], node.target)(*args[1:], **kwargs)
    else:
        value = node.target(*args, **kwargs)
    if isinstance(value, torch.Tensor) and value.numel() > _MAX_ELEMENTS:
        raise _NotConstant
    return value


def _reads_shape_only(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) > 1 and node.args[1] in _ATTRIBUTES
    return op_name(node) in _SHAPE_READS


def _stand_in(node) -> torch.Tensor:
    """A CPU tensor of the node's captured shape and dtype (values unread: a broadcast)."""
    shape = node_shape(node)
    info = get_info(node) if isinstance(node, fx.Node) else None
    if shape is None or info is None or not info.dtypes:
        raise _NotConstant
    return torch.zeros((), dtype=info.dtypes[0]).expand(shape)


def _ancestors(node: fx.Node) -> list[fx.Node]:
    """`node` and every node its value is computed from (not through shape reads), in
    graph order."""
    seen, stack = {node}, [node]
    while stack:
        current = stack.pop()
        inputs = current.all_input_nodes
        if _reads_shape_only(current):
            inputs = [a for a in inputs if a is not current.args[0]]
        for arg in inputs:
            if arg not in seen:
                seen.add(arg)
                stack.append(arg)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _on_cpu(a):
    return torch.device("cpu") if isinstance(a, torch.device) else a


def _arg(node: fx.Node, index: int | None, name: str):
    if index is not None and len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name)
