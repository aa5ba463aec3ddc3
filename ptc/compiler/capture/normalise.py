"""Input, output and loss normalisation: one calling convention for every graph.

Terms: the graph takes the placeholders `tokens` and, with a loss,
`targets`, and returns one output. *Checks* are nodes that only re-check
what capture already specialised (concrete args, export's input guards);
they would pin the graph to no purpose and are erased.

The output rule: the *logits* are the output named "logits", else the
floating [b, s, V] tensor (largest V); the *model's loss* is the output
named "loss", else its 0-d floating tensor. With `with_loss`, the graph
returns the model's own loss when forward took targets, else the mean
cross-entropy of logits[b·s, V] against targets[b·s] appended to the graph
(module path "", so every other node keeps the user's module path). A model
that then returns another loss term by name (a mixture of experts' "aux_loss"
with transformers' `output_router_logits`, which the library adds to its loss
only when given labels) is refused: the appended loss would train without it.

Job: rewrite a door's graph to that convention and propagate shapes
through the result.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.nn import functional as F
from torch.utils._pytree import tree_unflatten

from ptc.compiler.capture.call import CallRule
from ptc.compiler.capture.evaluate import Evaluator
from ptc.compiler.capture.messages import no_logits_message
from ptc.compiler.graph.nodes import has_effect
from ptc.errors import CaptureError

# Nodes that only re-check what capture already specialised (concrete args,
# export's input guards); they would pin the graph to no purpose.
_CHECK_FUNCTIONS = {torch._assert, fx._symbolic_trace._assert_is_none}
_CHECK_OPS = {"_assert_tensor_metadata", "_assert_scalar", "_assert_async",
              "sym_constrain_range", "sym_constrain_range_for_size"}


def _is_check(node: fx.Node) -> bool:
    if node.op == "call_module":
        return str(node.target).startswith("_guards_fn")
    if node.op != "call_function":
        return False
    if node.target in _CHECK_FUNCTIONS:
        return True
    return isinstance(node.target, torch._ops.OpOverload) and node.target._opname in _CHECK_OPS


def normalise_io(graph: fx.Graph, call: CallRule, evaluator: Evaluator, out_spec,
                 b: int, s: int, with_loss: bool, aten: bool,
                 model_name: str) -> tuple[int | None, bool]:
    """Make the graph take (tokens[, targets]) and return logits or the loss.

    Both doors' graphs leave here alike, so the passes meet one convention;
    every remaining node then has its meta value in `evaluator`. `aten`:
    the graph is the export door's, so an appended loss is made of aten ops.
    Returns (vocab, whether the loss is the model's own).
    """
    for node in reversed(list(graph.nodes)):
        if _is_check(node):
            graph.erase_node(node)
            evaluator.forget(node)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    tokens = next((n for n in placeholders if n.target == call.tokens), placeholders[0])
    targets = next((n for n in placeholders if call.targets and n.target == call.targets), None)
    out_node = graph.output_node()
    structure = out_node.args[0]
    if out_spec is not None:
        structure = tree_unflatten(list(structure), out_spec)
    logits, loss = _pick_outputs(structure, evaluator, b, s)
    model_loss = False
    if with_loss and loss is not None and targets is not None:
        result, model_loss = loss, True
    elif with_loss:
        if logits is None:
            raise CaptureError(no_logits_message(model_name, _named_leaves(structure),
                                                 evaluator, b, s))
        _refuse_loss_terms(structure, model_name)
        if targets is None:
            with graph.inserting_after(tokens):
                targets = graph.placeholder("targets")
            evaluator.inputs["targets"] = torch.zeros(b, s, dtype=torch.long, device="meta")
        with graph.inserting_before(out_node):
            value = evaluator.value(logits)
            result = _append_loss(graph, logits, targets, value.shape[-1],
                                  value.dtype != torch.float32, aten)
    else:
        if logits is None:
            raise CaptureError(no_logits_message(model_name, _named_leaves(structure),
                                                 evaluator, b, s))
        result = logits
    out_node.args = (result,)
    graph.eliminate_dead_code(is_impure_node=has_effect)  # an in-place call's effect stays
    for node in list(graph.nodes):
        if node.op == "placeholder" and node is not tokens and not node.users \
                and not (with_loss and node is targets):
            graph.erase_node(node)
    tokens.target = "tokens"
    if with_loss:
        targets.target = "targets"
    evaluator.memo = {n: v for n, v in evaluator.memo.items() if not n._erased}
    evaluator.inputs = {"tokens": evaluator.memo.get(tokens, evaluator.inputs[call.tokens]),
                        "targets": torch.zeros(b, s, dtype=torch.long, device="meta")}
    evaluator.run_all(graph)
    vocab = evaluator.value(logits).shape[-1] if logits is not None else None
    return vocab, model_loss


def _named_leaves(obj, name: str = ""):
    if isinstance(obj, fx.Node):
        yield name, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _named_leaves(value, str(key))
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            yield from _named_leaves(value, "")
    elif hasattr(obj, "__dataclass_fields__"):
        for key in obj.__dataclass_fields__:
            yield from _named_leaves(getattr(obj, key), key)


def _refuse_loss_terms(structure, model_name: str) -> None:
    """CaptureError naming the outputs called "..._loss" (other than "loss") that the
    appended cross-entropy would leave out of training."""
    terms = sorted({name for name, _ in _named_leaves(structure)
                    if name.endswith("_loss")})
    if terms:
        raise CaptureError(
            f"model {model_name}: its forward returns {', '.join(repr(t) for t in terms)}, a "
            f"loss term the cross-entropy ptc appends to the logits would not train (the "
            f"model adds it to its loss only when given labels); turn it off (transformers: "
            f"output_router_logits = False), or have forward(tokens, targets) return the "
            f"whole loss to train")


def _pick_outputs(structure, evaluator: Evaluator, b: int, s: int):
    """(logits node, loss node) of the model's outputs (see the output rule)."""
    leaves = list(_named_leaves(structure))
    named = {name: node for name, node in leaves if name}
    vals = {node: evaluator.value(node) for _, node in leaves}

    def floating(node):
        return isinstance(vals[node], torch.Tensor) and vals[node].is_floating_point()

    logits = named.get("logits")
    if logits is None:
        candidates = [n for _, n in leaves if floating(n) and vals[n].dim() == 3
                      and tuple(vals[n].shape[:2]) == (b, s)]
        logits = max(candidates, key=lambda n: vals[n].shape[-1], default=None)
    loss = named.get("loss")
    if loss is None:
        loss = next((n for _, n in leaves if floating(n) and vals[n].dim() == 0), None)
    return logits, loss


def _append_loss(graph: fx.Graph, logits: fx.Node, targets: fx.Node, vocab: int,
                 upcast: bool, aten: bool) -> fx.Node:
    """Append mean cross-entropy(logits[b·s, V], targets[b·s]) nodes; return the loss.

    `upcast`: the logits are in a 16-bit dtype, and the loss is computed on their float32
    copy, as torchtitan, Megatron-LM and transformers compute it: in bf16 each token's loss
    and its softmax gradient would carry bf16's 8 bits (the loss in steps of 1/64 near 4).
    """
    if aten:
        ops = torch.ops.aten
        flat = graph.call_function(ops.reshape.default, (logits, [-1, vocab]))
        if upcast:
            flat = graph.call_function(ops._to_copy.default, (flat,), {"dtype": torch.float32})
        flat_targets = graph.call_function(ops.reshape.default, (targets, [-1]))
        return graph.call_function(ops.cross_entropy_loss.default, (flat, flat_targets))
    flat = graph.call_method("reshape", (logits, -1, vocab))
    if upcast:
        flat = graph.call_method("float", (flat,))
    flat_targets = graph.call_method("reshape", (targets, -1))
    return graph.call_function(F.cross_entropy, (flat, flat_targets))
