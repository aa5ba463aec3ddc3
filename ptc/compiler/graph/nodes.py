"""Predicates passes use to recognise nodes, on both kinds of captured graph.

A graph from the fx front door has `call_module` nodes for leaf modules
(Linear, Embedding, LayerNorm, ...) and torch-level `call_function` /
`call_method` nodes for the rest. A graph from the export front door has
aten `call_function` nodes (`aten.linear`, `aten.addmm`, `aten.mm`,
`aten.embedding`, `aten.scaled_dot_product_attention`, ...) with the module
that made them in `node.meta["nn_module_stack"]`, and parameters as
`get_attr` nodes. Every predicate here answers for both, so a pass is
written once.

Terms: an op's *name* is its function / method / aten name without leading
underscores ("linear", "softmax", "unsafe_view"); a *transparent* op is one
that moves or re-types data without computing (view, transpose, to, ...).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import fx, nn

from ptc.compiler.graph.call_cache import changes_operands
from ptc.compiler.graph.meta import get_info

# ------------------------------------------------------------------ op names

NORM_MODULES = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)
ACTIVATION_MODULES = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Mish, nn.LeakyReLU,
                      nn.ELU, nn.Softplus)

LINEAR_OPS = frozenset({"linear"})
FP8_LINEAR_OPS = frozenset({"fp8_linear", "fp8_grouped_mm"})
"""ptc's float8 linear and grouped product (`ptc.ops.fp8_linear`, `ptc.ops.fp8_grouped`), which
the fp8_compute pass puts in the place of a layer's linear or its experts' grouped product: a
linear to the passes after it (a region keeps or recomputes it as one)."""
GROUPED_MM_OPS = frozenset({"grouped_mm", "grouped_mm_fallback"})
"""Products of token groups with a stack of per-expert weights [experts, in, out] (MoE
experts: torch's grouped_mm, transformers' fallback op)."""
MATMUL_OPS = frozenset({"matmul", "mm", "bmm", "baddbmm", "addmm", "addbmm", "einsum"})
ATTENTION_OPS = frozenset({"scaled_dot_product_attention",
                           "scaled_dot_product_flash_attention",
                           "scaled_dot_product_flash_attention_for_cpu",
                           "scaled_dot_product_efficient_attention",
                           "scaled_dot_product_cudnn_attention", "site_attention",
                           "context_attention"})
ALONG_DIM_OPS = {"softmax": ("dim", 1), "log_softmax": ("dim", 1), "cumsum": ("dim", 1),
                 "cumprod": ("dim", 1), "cummax": ("dim", 1), "cummin": ("dim", 1),
                 "logcumsumexp": ("dim", 1), "diff": ("dim", 2), "sort": ("dim", 1),
                 "argsort": ("dim", 1), "topk": ("dim", 2), "roll": ("dims", 2),
                 "flip": ("dims", 1)}
"""Ops that combine or reorder the elements along one dim: (keyword, argument index) of it."""
_LAST_DIM_BY_DEFAULT = frozenset({"sort", "argsort", "topk", "diff"})
"""Ops of ALONG_DIM_OPS whose dim, when not given, is the last one (the others flatten)."""
CONVOLUTION_OPS = frozenset({"conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d"})
"""Ops that combine neighbouring elements of their spatial dims (a causal convolution)."""
EMBEDDING_OPS = frozenset({"embedding"})
NORM_OPS = frozenset({"layer_norm", "native_layer_norm", "rms_norm", "fused_rms_norm",
                      "group_norm", "native_group_norm", "batch_norm", "native_batch_norm"})
SOFTMAX_OPS = frozenset({"softmax", "log_softmax", "safe_softmax"})
DROPOUT_OPS = frozenset({"dropout", "native_dropout", "feature_dropout", "dropout_",
                         "site_dropout"})


def _with_in_place(names: set[str]) -> frozenset[str]:
    """`names` and their in-place forms (`clamp_` of `clamp`): the same op on the same
    elements, written into its input (HF OLMo clips q, k and v with `clamp_`)."""
    return frozenset(names | {name + "_" for name in names})


ACTIVATION_OPS = _with_in_place({"gelu", "relu", "silu", "sigmoid", "tanh", "mish", "leaky_relu",
                                 "elu", "softplus"})
LOSS_OPS = frozenset({"cross_entropy", "cross_entropy_loss", "nll_loss", "nll_loss_forward",
                      "nll_loss_nd", "nll_loss2d_forward", "mse_loss"})
POINTWISE_OPS = _with_in_place({
    "add", "sub", "mul", "div", "truediv", "floordiv", "pow", "rsqrt", "sqrt", "exp", "log",
    "neg", "abs", "reciprocal", "square", "sin", "cos", "erf", "addcmul", "addcdiv", "lerp",
    "clamp", "clip", "clamp_min", "clamp_max", "maximum", "minimum", "where", "masked_fill",
    "rsub", "radd", "rmul", "iadd", "imul", "isub", "itruediv", "exp2", "log1p", "expm1",
    "sign", "fmod", "remainder", "copysign", "logical_not", "logical_and", "logical_or",
    "bitwise_not", "bitwise_and", "bitwise_or", "bitwise_xor", "logical_xor",
    "gt", "lt", "ge", "le", "eq", "ne", "greater", "less", "greater_equal", "less_equal",
})
REDUCTION_OPS = frozenset({"mean", "sum", "var", "std", "var_mean", "amax", "amin", "max",
                           "min", "norm", "logsumexp", "argmax", "argmin", "prod", "any", "all"})
VIEW_OPS = frozenset({
    "view", "reshape", "unsafe_view", "transpose", "t", "permute", "contiguous", "expand",
    "expand_as", "unsqueeze", "squeeze", "flatten", "unflatten", "getitem", "split",
    "split_with_sizes", "chunk", "unbind", "cat", "concat", "stack", "slice", "select",
    "index_select", "narrow", "clone", "to", "type", "type_as", "float", "half", "bfloat16",
    "to_copy", "repeat", "repeat_interleave", "detach", "alias", "getattr", "size", "dim",
    "index", "gather", "movedim", "swapaxes", "view_as", "reshape_as", "masked_select",
    "assert_tensor_metadata",
})
CREATION_OPS = frozenset({
    "arange", "ones", "zeros", "full", "empty", "ones_like", "zeros_like", "full_like",
    "empty_like", "tensor", "scalar_tensor", "triu", "tril", "new_ones", "new_zeros",
    "new_full", "new_empty", "lift_fresh_copy", "rand", "randn", "rand_like", "randn_like",
    "empty_strided", "new_empty_strided", "finfo",
})
CAST_OPS = frozenset({"contiguous", "clone", "to", "type", "type_as", "float", "half", "bfloat16",
                      "to_copy", "detach", "alias"})
"""Ops that change how a tensor is stored or typed, never its dimensions."""
TRANSPARENT_OPS = frozenset({
    "view", "reshape", "unsafe_view", "transpose", "t", "permute", "contiguous", "expand",
    "clone", "to", "type", "type_as", "float", "half", "bfloat16", "to_copy", "detach",
    "alias", "unsqueeze", "squeeze", "flatten", "context_chunks",
})
CROSS_ENTROPY_OPS = frozenset({"cross_entropy", "cross_entropy_loss"})
"""The losses whose logits come from an LM head."""
# Ops between the score matmul and the softmax of written-out attention:
# scaling, masking, dtype casts.
_SCORE_OPS = TRANSPARENT_OPS | {"mul", "div", "truediv", "add", "sub", "masked_fill", "where",
                                 "tanh"}  # tanh: Gemma 2's soft-capping of the scores
_PROBS_OPS = TRANSPARENT_OPS | DROPOUT_OPS | {"getitem"}


def walk(starts: Iterable[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]]
         ) -> Iterator[fx.Node]:
    """Each node reachable from `starts` by `step` (a node -> the nodes to visit from it),
    once, depth first: the one graph walk of the passes (a caller stops it early by
    leaving the loop, or raises from `step`)."""
    todo, seen = list(starts), set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        todo.extend(step(node))


def op_name(node: fx.Node) -> str:
    """The node's op name without leading underscores ("linear", "softmax").

    For call_module nodes, the module's class name; for placeholder, get_attr
    and output nodes, the node's op.
    """
    if node.op == "call_module":
        cls = module_type(node)
        return cls if isinstance(cls, str) else cls.__name__
    if node.op == "call_method":
        return str(node.target).lstrip("_")
    if node.op != "call_function":
        return node.op
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._opname.lstrip("_")
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1].lstrip("_")
    return getattr(target, "__name__", str(target)).lstrip("_")


def where(node: fx.Node) -> str:
    """"node N (op) in module M at file:line" for messages."""
    meta = get_info(node)
    text = f"node {node.name} ({op_name(node)})"
    if meta is not None and meta.module_path:
        text += f" in module {meta.module_path!r}"
    if meta is not None and meta.source:
        text += f" at {meta.source}"
    return text


def mixes_along(node: fx.Node, x: fx.Node, dim: int) -> bool:
    """Whether `node` combines or reorders the elements of its input `x` along `dim`: a
    softmax, cumulative op, sort, top-k or roll along it (a sort or top-k without a dim runs
    along the last; a roll without one along all), a convolution. Such an op is wrong on a
    rank's part of that dim."""
    name = op_name(node).lower()
    if name in CONVOLUTION_OPS:
        return True
    if name not in ALONG_DIM_OPS or node.args[:1] != (x,):
        return False
    key, index = ALONG_DIM_OPS[name]
    dims = node.kwargs.get(key, node.args[index] if len(node.args) > index else None)
    if dims is None and name in _LAST_DIM_BY_DEFAULT:
        dims = -1  # a router's topk over the experts of each token row
    if dims is None:  # roll of the flattened tensor, a softmax of torch's implicit dim
        return True
    rank = len(get_info(x).shapes[0])
    return dim in {d % rank for d in (dims if isinstance(dims, (list, tuple)) else (dims,))}


def has_effect(node: fx.Node) -> bool:
    """Whether dead-code elimination must keep `node` though nothing reads its result: fx's
    impure nodes, and calls that write into an operand (`x.clamp_(-c, c)`, `out=`), whose
    effect is the operand's new value. Pass it as `eliminate_dead_code(is_impure_node=...)`."""
    return node.is_impure() or changes_operands(node)


# ----------------------------------------------------------- module lookup


def module_of(node: fx.Node) -> nn.Module | None:
    """The module a call_module node calls (None when the graph has no owner yet)."""
    if node.op != "call_module":
        return None
    owner = node.graph.owning_module
    if owner is None:
        return None
    try:
        return owner.get_submodule(node.target)
    except AttributeError:
        return None


def module_type(node: fx.Node) -> type | str:
    """Class (fx graphs) or qualified class name (export graphs) of the node's module."""
    mod = module_of(node)
    if mod is not None:
        return type(mod)
    _, cls = stack_entry(node)
    return cls


def stack_entry(node: fx.Node) -> tuple[str, type | str]:
    """(path, class) of the innermost module on the node's nn_module_stack; ("", "") if none.

    fx records classes, torch.export qualified class names; export also puts
    the root module on the stack with path "".
    """
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return "", ""
    path, cls = next(reversed(stack.values()))
    return _clean_path(path), cls


def _clean_path(path: str) -> str:
    # Strict-mode export spells paths "L['self'].layers[0]"; keep the fqn form.
    if path.startswith("L['self']"):
        path = path[len("L['self']"):].lstrip(".")
        path = path.replace("[", ".").replace("]", "")
    return path


def class_name(cls: type | str) -> str:
    """Short class name of a class or of a qualified class-name string."""
    if isinstance(cls, str):
        return cls.rpartition(".")[2]
    return cls.__name__


@functools.lru_cache(maxsize=512)
def _resolve(qualified: str) -> type | str:
    """The class a qualified name ("torch.nn.modules.linear.Linear") names, else the name.

    Export records module classes by name; resolving them lets subclasses of
    nn.Linear & co. be recognised as such. Only modules already imported are
    searched (the model's classes are), so nothing is imported here; classes
    defined inside functions stay names.
    """
    module_name, _, attr = qualified.rpartition(".")
    while module_name:
        obj = sys.modules.get(module_name)
        if obj is None:
            module_name, _, head = module_name.rpartition(".")
            attr = f"{head}.{attr}"
            continue
        for part in attr.split("."):
            obj = getattr(obj, part, None)
        return obj if isinstance(obj, type) else qualified
    return qualified


def _is_a(cls: type | str, kinds: tuple[type, ...], names: tuple[str, ...] = ()) -> bool:
    if isinstance(cls, str) and "." in cls:
        cls = _resolve(cls)
    if isinstance(cls, type):
        return issubclass(cls, kinds) or cls.__name__ in names
    name = class_name(cls)
    return name in {k.__name__ for k in kinds} or name in names


def is_norm_class(cls: type | str) -> bool:
    """Whether a module class is a normalisation (torch's or one named *Norm)."""
    return bool(cls) and (_is_a(cls, NORM_MODULES) or class_name(cls).endswith("Norm"))


def module_path(node: fx.Node) -> str:
    """Module path of a node: its NodeInfo's when captured, else from the graph."""
    meta = get_info(node)
    if meta is not None:
        return meta.module_path
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    return stack_entry(node)[0]


# -------------------------------------------------------------- parameters


def get_attr_value(node: fx.Node):
    """The object a get_attr node reads (None when the graph has no owner)."""
    owner = node.graph.owning_module
    if owner is None or node.op != "get_attr":
        return None
    obj = owner
    for part in str(node.target).split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def param_source(node) -> str | None:
    """Name of the parameter `node` is, or is a transpose/cast/view of; None if not one."""
    for _ in range(6):
        if not isinstance(node, fx.Node):
            return None
        if node.op == "get_attr":
            value = get_attr_value(node)
            if value is None or isinstance(value, nn.Parameter):
                return str(node.target)
            return None
        if op_name(node) not in TRANSPARENT_OPS or not node.args:
            return None
        node = node.args[0]
    return None


def params_behind(gm: fx.GraphModule) -> dict[fx.Node, tuple[str, ...]]:
    """For every node computed from weights alone (a parameter, its transpose, Gemma's
    1 + w, xIELU's softplus(alpha)), the names of the parameters it reads: a gradient
    arriving there reaches them, so where such a node is read decides how their gradient
    is summed. Whatever depends on a graph input is left out, and so are ptc's own ops
    (collectives). One pass in graph order."""
    out: dict[fx.Node, tuple[str, ...]] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            name = param_source(n)
            out[n] = (name,) if name is not None else ()
        elif n.op in ("call_function", "call_method") and n.all_input_nodes and \
                not getattr(n.target, "__module__", "").startswith("ptc.") and \
                all(a in out for a in n.all_input_nodes):
            out[n] = tuple(dict.fromkeys(x for a in n.all_input_nodes for x in out[a]))
    return out


def _arg(node: fx.Node, index: int, name: str):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name)


def _weight_arg(node: fx.Node):
    name = op_name(node)
    if name == "linear":
        return _arg(node, 1, "weight")
    if name in GROUPED_MM_OPS:
        return _arg(node, 1, "weight")
    if name == "addmm":
        return _arg(node, 2, "mat2")
    if name in ("mm", "matmul"):
        return _arg(node, 1, "mat2" if name == "mm" else "other")
    return None


def linear_weight(node: fx.Node) -> str | None:
    """Full name of the weight a linear node multiplies by ("head.weight"); None if no linear."""
    if node.op == "call_module":
        mod = module_of(node)
        cls = type(mod) if mod is not None else module_type(node)
        return f"{node.target}.weight" if _is_a(cls, (nn.Linear,)) else None
    if node.op != "call_function" and node.op != "call_method":
        return None
    return param_source(_weight_arg(node))


def linear_out_dim(node: fx.Node) -> int | None:
    """The dimension of a linear's stored weight that holds its output features.

    0 for nn.Linear / F.linear's [out, in] weight, 1 for a weight a matrix
    product multiplies by as stored ([in, out], GPT-2's Conv1D); each
    transpose on the way from the parameter to the op flips it. None when
    the way there reshapes the weight (its features are not one dimension).
    """
    if node.op == "call_module":
        return 0 if linear_weight(node) else None
    name = op_name(node)
    # In the operand the op reads: [out, in] for linear, [in, out] for a matrix product,
    # [experts, in, out] for a grouped one.
    dim = 0 if name == "linear" else 2 if name in GROUPED_MM_OPS else 1
    operand = _weight_arg(node)
    for _ in range(6):
        if not isinstance(operand, fx.Node):
            return None
        if operand.op == "get_attr":
            return dim
        step = op_name(operand)
        if step == "t":
            dim = 1 - dim
        elif step == "transpose":
            ndim = len(node_shape(operand.args[0]) or ())
            a, b = (d % ndim for d in operand.args[1:3]) if ndim else operand.args[1:3]
            dim = b if dim == a else a if dim == b else dim
        elif step == "permute":
            dim = list(operand.args[1])[dim] % len(operand.args[1])
        elif step not in CAST_OPS:
            return None
        operand = operand.args[0]
    return None


def linear_in_dim(node: fx.Node) -> int | None:
    """The dimension of a linear's stored weight that holds its input features: the other
    one of its last two ([out, in], [in, out], or an expert stack's [experts, ., .])."""
    out = linear_out_dim(node)
    if out is None:
        return None
    ndim = 2 if node.op == "call_module" else len(node_shape(_weight_arg(node)) or (0, 0))
    return (2 * ndim - 3) - out


def logits_linear(loss: fx.Node) -> fx.Node | None:
    """The linear node a cross-entropy takes its logits from, through reshapes, casts and
    elementwise ops of the logits alone (Gemma 2's soft-capping); None when there is none."""
    node = loss.args[0] if loss.args else None
    while isinstance(node, fx.Node) and not is_linear(node) and node.args and (
            op_name(node) in TRANSPARENT_OPS or _of_one_tensor(node)):
        node = node.args[0]
    return node if isinstance(node, fx.Node) and is_linear(node) else None


def _of_one_tensor(node: fx.Node) -> bool:
    """An elementwise op whose only tensor operand is its first (the others numbers)."""
    info = get_info(node)
    return info is not None and info.kind in ("pointwise", "activation") and \
        len(node.all_input_nodes) == 1 and node.args[0] is node.all_input_nodes[0]


def is_linear(node: fx.Node) -> str | None:
    """Module path of the Linear a node applies ("layers.3.attn.q"), or None.

    A call_module Linear (fx), or aten.linear / F.linear / addmm / mm / matmul
    whose weight operand is a parameter (export, or hand-written linears).
    The path is that of the calling nn.Linear when there is one, so a head
    whose weight is tied to the embedding is still "head"; for a grouped
    product with an expert stack (`GROUPED_MM_OPS`), the stack's own name
    ("layers.0.mlp.experts.down_proj").
    """
    weight = linear_weight(node)
    if weight is None:
        return None
    if node.op == "call_module":
        return str(node.target)
    if op_name(node) in GROUPED_MM_OPS:  # an expert stack: one module may hold several
        return weight
    path, cls = stack_entry(node)
    if cls and _is_a(cls, (nn.Linear,)):
        return path
    return weight.rpartition(".")[0] or weight  # a weight of the root module: its own name


def is_fp8_linear(node: fx.Node) -> str | None:
    """Module path of a linear whose GEMMs `train.dtype = fp8` runs in float8, or None.

    The linears of the transformer layers (a layer index from capture), as
    Transformer Engine's recipe has it: the embedding and the LM head (no
    layer) stay in the compute dtype, and so do linears whose weight is not
    one [out, in] or [in, out] matrix, and a mixture of experts' routers
    (`picks_experts`), which Megatron-Core keeps in high precision: their
    scores decide where every token goes. Expert stacks' grouped products are
    `is_fp8_grouped`'s.
    """
    if op_name(node) in GROUPED_MM_OPS or picks_experts(node):
        return None
    return _fp8_gemm(node)


_TOWARD_TOPK = TRANSPARENT_OPS | SOFTMAX_OPS | POINTWISE_OPS | {"sigmoid"}
"""Ops a router's logits pass on their way to the top-k choice of experts (casts, a softmax
or sigmoid, a correction bias, a scale)."""


def picks_experts(node: fx.Node) -> bool:
    """Whether `node`'s output reaches a top-k through element-wise ops only: a mixture of
    experts' router, whose scores choose each token's experts."""
    def onward(n: fx.Node) -> list[fx.Node]:
        return [u for u in n.users if op_name(u) in _TOWARD_TOPK]

    return any(op_name(u) == "topk" for n in walk([node], onward) for u in n.users)


def is_fp8_grouped(node: fx.Node) -> str | None:
    """Name of the expert stack of a grouped product whose GEMMs `train.dtype = fp8` runs in
    float8, or None.

    The routed experts' products of the transformer layers (`GROUPED_MM_OPS`
    with group offsets), as Megatron-Core runs them with Transformer
    Engine's grouped linear, whose weight operand is the stack itself, up to
    transposes and casts, and which adds no bias and keeps its output dtype: a
    stack sliced or reshaped on the way stays in the compute dtype.
    """
    if op_name(node) not in GROUPED_MM_OPS or not isinstance(_arg(node, 2, "offs"), fx.Node) \
            or _arg(node, 3, "bias") is not None or _arg(node, 4, "out_dtype") is not None:
        return None
    return _fp8_gemm(node)


def _fp8_gemm(node: fx.Node) -> str | None:
    """`is_linear`'s path of a layer's linear whose weight is one matrix (a stack of them)."""
    path = is_linear(node)
    info = get_info(node)
    if path is None or info is None or info.layer is None or linear_out_dim(node) is None:
        return None
    return path


def is_embedding(node: fx.Node) -> str | None:
    """Module path of the embedding table a lookup node reads, or None."""
    if node.op == "call_module":
        cls = module_type(node)
        return str(node.target) if cls and _is_a(cls, (nn.Embedding,)) else None
    if node.op != "call_function" or op_name(node) not in EMBEDDING_OPS:
        return None
    # aten.embedding(weight, indices) vs F.embedding(input, weight)
    is_aten = isinstance(node.target, torch._ops.OpOverload)
    weight = param_source(node.args[0] if is_aten else _arg(node, 1, "weight"))
    path, cls = stack_entry(node)
    if cls and _is_a(cls, (nn.Embedding,)):
        return path
    return weight.rpartition(".")[0] if weight else path


def is_norm(node: fx.Node) -> str | None:
    """Module path of the normalisation whose output this node is, or None.

    A call_module norm (fx), an aten/functional norm op, or — for a norm the
    front door traced through (a hand-written RMSNorm) — the last node inside
    a module whose class name ends in "Norm".
    """
    if node.op == "call_module":
        return str(node.target) if is_norm_class(module_type(node)) else None
    if node.op not in ("call_function", "call_method"):
        return None
    path, cls = stack_entry(node)
    if op_name(node) in NORM_OPS:
        return path if cls and is_norm_class(cls) else module_path(node)
    if not (cls and is_norm_class(cls)):
        return None
    inside = [u for u in node.users if u.op != "output" and module_path(u) == path]
    return None if inside else path


# --------------------------------------------------------------- attention


@dataclass(frozen=True, slots=True)
class AttentionParts:
    """The nodes of one attention: query, key, value operands and the output node."""

    q: fx.Node
    k: fx.Node
    v: fx.Node
    out: fx.Node
    fused: bool
    """True for scaled_dot_product_attention, False for matmul-softmax-matmul."""
    scores: fx.Node | None = None
    """Written out: the softmax's input (the scores after scaling and masking); else None."""
    sinks: fx.Node | None = None
    """Written out with attention sinks (GPT-OSS): the per-head logits joined to each row of
    scores before the softmax, whose column the probabilities then drop; else None."""


def _back(node, through: frozenset[str], hops: int = 8):
    """Follow the data operand back (`data_operand`) while the ops are in `through`."""
    for _ in range(hops):
        if not isinstance(node, fx.Node) or _functional_name(node) not in through \
                or not node.args:
            return node
        node = data_operand(node)
    return node


def data_operand(node: fx.Node):
    """The operand whose values `node` carries on toward an attention's softmax: the first,
    but for `where(condition, a, b)` the one of a and b shaped as its output (a where both
    are: GPT-Neo's `where(causal, scores, min)`)."""
    if op_name(node) != "where" or len(node.args) < 3:
        return node.args[0]
    shape = node_shape(node)
    a, b = node.args[1], node.args[2]
    return b if node_shape(a) != shape and node_shape(b) == shape else a


def _functional_name(node: fx.Node) -> str:
    """op_name, except that a call to a dropout or softmax module (nn.Dropout, nn.Softmax,
    as nanoGPT and GPT-2 write attention) is named as the functional op it stands for."""
    if node.op == "call_module":
        kind = module_kind(module_type(node))
        if kind in ("dropout", "softmax"):
            return kind
    return op_name(node)


def _matmul_operands(node: fx.Node):
    name = op_name(node)
    if name in ("matmul", "mm", "bmm"):
        return node.args[0], node.args[1]
    if name in ("baddbmm", "addmm", "addbmm"):
        return node.args[1], node.args[2]
    return None


def attention_parts(node: fx.Node) -> AttentionParts | None:
    """The attention whose output `node` is, or None.

    Fused: a scaled_dot_product_attention op (torch or aten, any backend).
    Written out: the matmul of probabilities and values, where the
    probabilities come from a softmax (then maybe dropout/casts) of scores
    that come from a matmul (then maybe scale/mask/casts).
    """
    if node.op not in ("call_function", "call_method"):
        return None
    name = op_name(node)
    if name in ATTENTION_OPS:
        return AttentionParts(_arg(node, 0, "query"), _arg(node, 1, "key"),
                              _arg(node, 2, "value"), node, True)
    operands = _matmul_operands(node) if name in MATMUL_OPS else None
    if operands is None or param_source(operands[1]) is not None:
        return None
    probs = _back(operands[0], _PROBS_OPS)
    dropped = _sink_column_dropped(probs)
    if dropped:
        probs = _back(probs.args[0], _PROBS_OPS)
    if not isinstance(probs, fx.Node) or _functional_name(probs) not in SOFTMAX_OPS:
        return None
    scores, sinks = _back(probs.args[0], _SCORE_OPS), None
    if dropped and isinstance(scores, fx.Node) and op_name(scores) == "cat" \
            and len(scores.args[0]) == 2 and _arg(scores, 1, "dim") in (-1, 3):
        scores, sinks = scores.args[0]
        scores = _back(scores, _SCORE_OPS)
    if not isinstance(scores, fx.Node) or op_name(scores) not in MATMUL_OPS or dropped != (
            sinks is not None):
        return None
    qk = _matmul_operands(scores)
    if qk is None:
        return None
    return AttentionParts(qk[0], qk[1], operands[1], node, False, probs.args[0], sinks)


def _sink_column_dropped(node) -> bool:
    """Whether `node` drops the last column of the keys dim (`probs[..., :-1]`): where
    attention sinks leave the softmax."""
    if not isinstance(node, fx.Node) or op_name(node) != "slice":
        return False
    dim, start, end = (_arg(node, i, name) for i, name in ((1, "dim"), (2, "start"),
                                                           (3, "end")))
    return dim in (-1, 3) and start in (None, 0) and end == -1


def is_attention(node: fx.Node) -> bool:
    """Whether the node is the output of an attention (fused SDPA or written out)."""
    return attention_parts(node) is not None


# ---------------------------------------------------------------- reshapes


@dataclass(frozen=True, slots=True)
class HeadsReshape:
    """A reshape between [..., heads·head_dim] and [..., heads, head_dim]."""

    split: bool
    """True for [..., h] -> [..., a, d]; False for [..., a, d] -> [..., h]."""
    heads: int
    head_dim: int


def node_shape(node) -> tuple[int, ...] | None:
    """Shape of a node's (first) tensor output, from NodeInfo or torch's "val"."""
    if not isinstance(node, fx.Node):
        return None
    meta = get_info(node)
    if meta is not None and meta.shapes:
        return meta.shapes[0]
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(val.shape)
    return None


def _is_floating(node: fx.Node) -> bool:
    meta = get_info(node)
    if meta is not None and meta.dtypes:
        return meta.dtypes[0].is_floating_point
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


_RESHAPE_OPS = frozenset({"view", "reshape", "unsafe_view", "unflatten", "flatten"})


def heads_reshape(node: fx.Node) -> HeadsReshape | None:
    """How a reshape splits or merges attention heads, or None if it does not."""
    if node.op not in ("call_function", "call_method") or op_name(node) not in _RESHAPE_OPS:
        return None
    src, out = node_shape(node.args[0]) if node.args else None, node_shape(node)
    if src is None or out is None or not _is_floating(node):
        return None
    # Heads live beside at least one token dimension: [.., tokens, a, d] <-> [.., tokens, h]
    # (this keeps e.g. flattening targets[b, s] -> [b·s] out).
    if len(out) == len(src) + 1 and len(out) >= 3 and _splits(src, out):
        return HeadsReshape(True, out[-2], out[-1])
    if len(src) == len(out) + 1 and len(src) >= 3 and _splits(out, src):
        return HeadsReshape(False, src[-2], src[-1])
    return None


def _splits(flat: tuple[int, ...], split: tuple[int, ...]) -> bool:
    """Whether `split` is `flat` with its last dim h written as (a, d), a, d > 1."""
    return split[:-2] == flat[:-1] and split[-2] * split[-1] == flat[-1] \
        and split[-2] > 1 and split[-1] > 1


def is_reshape_of_heads(node: fx.Node) -> bool:
    """Whether the node reshapes [..., a·d] <-> [..., a, d] (heads split or merge)."""
    return heads_reshape(node) is not None


# ------------------------------------------------------------------- kinds


def classify(node: fx.Node) -> str:
    """The node's kind (see ptc.compiler.records.graph_meta.KINDS), from its op and operands."""
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return "output"
    if node.op == "get_attr":
        value = get_attr_value(node)
        return "param" if isinstance(value, nn.Parameter) else "buffer"
    if node.op == "call_module":
        return module_kind(module_type(node))
    name = op_name(node)
    if is_attention(node):
        return "attention"
    if name in LINEAR_OPS | FP8_LINEAR_OPS or (name in MATMUL_OPS | GROUPED_MM_OPS
                                                and linear_weight(node)):
        return "linear"
    if name in _MIN_MAX and len(node.args) > 1 and node_shape(node.args[1]) is not None:
        return "pointwise"  # torch.min(x, other): elementwise, not a reduction over a dim
    for kind, names in _NAME_KINDS:
        if name in names:
            return kind
    return "other"


def module_kind(cls: type | str) -> str:
    """The kind of a call to a leaf module of class `cls` ("other" for unknown classes)."""
    if not cls:
        return "other"
    if _is_a(cls, (nn.Linear,)):
        return "linear"
    if _is_a(cls, (nn.Embedding,)):
        return "embedding"
    if is_norm_class(cls):
        return "norm"
    if _is_a(cls, (nn.Dropout,)):
        return "dropout"
    if _is_a(cls, ACTIVATION_MODULES):
        return "activation"
    if _is_a(cls, (nn.Softmax, nn.LogSoftmax)):
        return "softmax"
    if _is_a(cls, (nn.MultiheadAttention,)):
        return "attention"
    return "other"


_MIN_MAX = frozenset({"min", "max"})
"""Reductions (`x.max(dim)`) that are elementwise when their second operand is a tensor."""
_NAME_KINDS = (("matmul", MATMUL_OPS), ("embedding", EMBEDDING_OPS), ("norm", NORM_OPS),
               ("softmax", SOFTMAX_OPS), ("dropout", DROPOUT_OPS),
               ("activation", ACTIVATION_OPS), ("loss", LOSS_OPS),
               ("pointwise", POINTWISE_OPS), ("reduction", REDUCTION_OPS),
               ("view", VIEW_OPS), ("creation", CREATION_OPS))
