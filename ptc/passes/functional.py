"""Turn a call to a leaf module with parameters into the functional op on get_attr nodes.

Passes that must reach a module's parameters one by one — split a
row-parallel linear's bias off its matmul, wrap a norm's weight in a
collective — first rewrite `call_module layers.0.attn.o(x)` into
`linear(x, layers_0_attn_o_weight, layers_0_attn_o_bias)` with the weight
and bias as `get_attr` nodes. The new node keeps the call's name and
metadata, so the graph reads as before.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import fx, nn

from ptc.compiler.graph.meta import copy_meta
from ptc.errors import CompileError


def param_node(gm: fx.GraphModule, src: fx.Node, name: str) -> fx.Node:
    """A get_attr node reading parameter `name`, inserted before `src`, with `src`'s provenance."""
    param = gm.get_parameter(name)
    with gm.graph.inserting_before(src):
        node = gm.graph.get_attr(name)
    copy_meta(src, node, kind="param", shapes=(tuple(param.shape),), dtypes=(param.dtype,),
              flops=0, params=param.numel(), param_bytes=param.numel() * param.dtype.itemsize)
    return node


def functional_op(node: fx.Node, module: nn.Module, weight) -> tuple:
    """(fn, args) of the functional op equal to calling leaf `module` at `node`.

    `weight(leaf)` gives the node that reads parameter `module.<leaf>` (only
    called for parameters the module has), so a pass decides where weights
    come from: get_attr nodes, or views of gathered ZeRO-3 shards.
    """
    if len(node.args) != 1 or node.kwargs:
        raise CompileError(f"{node.target} ({type(module).__name__}) is called with "
                           f"{len(node.args)} args and {len(node.kwargs)} kwargs; expected one input")

    def w(leaf: str):
        return None if getattr(module, leaf, None) is None else weight(leaf)

    x = node.args[0]
    if isinstance(module, nn.Linear):
        return F.linear, (x, w("weight"), w("bias"))
    if isinstance(module, nn.Embedding):
        return F.embedding, (x, w("weight"), module.padding_idx, module.max_norm,
                             module.norm_type, module.scale_grad_by_freq, module.sparse)
    if isinstance(module, nn.LayerNorm):
        return F.layer_norm, (x, tuple(module.normalized_shape), w("weight"), w("bias"),
                              module.eps)
    if isinstance(module, nn.RMSNorm):
        return F.rms_norm, (x, tuple(module.normalized_shape), w("weight"), module.eps)
    raise CompileError(f"cannot reach the parameters of {node.target} "
                       f"({type(module).__name__}): leaf modules with parameters must be "
                       "Linear, Embedding, LayerNorm or RMSNorm")


def replace_call(gm: fx.GraphModule, node: fx.Node, fn, args: tuple) -> fx.Node:
    """Put call_function `fn(*args)` in place of `node`, with its name and metadata."""
    with gm.graph.inserting_before(node):
        new = gm.graph.create_node("call_function", fn, args)
    copy_meta(node, new)
    node.replace_all_uses_with(new)
    name = node.name
    gm.graph.erase_node(node)
    new.name = name  # the functional call stands for the module call: keep its readable name
    return new


def functionalize(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    """Replace a call_module Linear / Embedding / LayerNorm / RMSNorm by its functional op.

    Returns the new call_function node (same name, same metadata); other
    nodes are returned unchanged.
    """
    if node.op != "call_module":
        return node
    module = gm.get_submodule(str(node.target))
    fn, args = functional_op(node, module,
                             lambda leaf: param_node(gm, node, f"{node.target}.{leaf}"))
    return replace_call(gm, node, fn, args)
