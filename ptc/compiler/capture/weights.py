"""Weights: capture never allocates one; its graphs bind to real ones afterwards.

Terms: a *meta model* is the model with every parameter and buffer an
empty meta tensor (floating ones in the compute dtype), the module tree and
weight ties unchanged; both front doors trace it. A *bound* graph is a
captured graph whose call_module / get_attr targets resolve in a
materialised model with the same module paths, so it can run.

Job: make the meta model before capture, and bind a captured graph to real
weights after it.
"""

from __future__ import annotations

import copy

import torch
from torch import fx, nn

from ptc.compiler.graph.devices import bind_device
from ptc.compiler.graph.lazy_code import graph_module, owner_module
from ptc.compiler.graph.meta import graph_info
from ptc.compiler.records.graph_meta import KEY


def meta_model(model: nn.Module, dtype: torch.dtype, *, buffers_as_built: bool = False
               ) -> nn.Module:
    """The model itself if it is all meta in `dtype`, else a meta copy of it.

    Capture reads only shapes and dtypes, so a model of any size is captured
    without allocating its weights.

    The copy (`copy_with_tensors`) has every parameter and buffer an empty
    meta tensor (floating ones in `dtype`; with `buffers_as_built`, buffers
    keep their own dtype, as the runtime binds them: `ptc.runtime.init`).
    """
    def target(t: torch.Tensor) -> torch.dtype:
        keep = not t.is_floating_point() or (buffers_as_built and not isinstance(t, nn.Parameter))
        return t.dtype if keep else dtype

    tensors = [t for m in model.modules()
               for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]
    if all(t.device.type == "meta" and t.dtype == target(t) for t in tensors):
        return model
    return copy_with_tensors(model, lambda t: torch.empty_like(t, device="meta",
                                                               dtype=target(t)))


def copy_with_tensors(model: nn.Module, make) -> nn.Module:
    """A deepcopy of `model` whose every parameter and buffer t is `make(t)` instead.

    The deepcopy's memo maps each tensor to its replacement, so no weight is
    copied and tied parameters stay tied.
    """
    memo: dict = {}
    for m in model.modules():
        for store, is_param in ((m._parameters, True), (m._buffers, False)):
            for t in store.values():
                if t is None or id(t) in memo:
                    continue
                made = make(t)
                memo[id(t)] = nn.Parameter(made, requires_grad=t.requires_grad) \
                    if is_param else made
    return copy.deepcopy(model, memo)


def with_weights(gm: fx.GraphModule, model: nn.Module) -> fx.GraphModule:
    """A runnable copy of a captured graph whose parameters and buffers are `model`'s.

    A graph is captured on meta; to run it (eager checks, tests) bind it to a
    materialised model with the same module paths: the new GraphModule looks
    every call_module / get_attr target up in `model`, so weights are shared,
    not copied, and non-persistent buffers (RoPE tables) come along. The
    graph, with its NodeInfo metadata, is copied; `gm` is left untouched.
    Compute happens in the dtype of `model`'s tensors. An export-door graph
    records the device of the tensors it creates (`arange(..., device=meta)`);
    those become the device of `model`'s parameters. The constants export
    lifted out of the forward (a tensor it builds from a Python number) are
    not `model`'s: they come from the capture (`CaptureInfo.constants`).
    """
    graph = fx.Graph()
    val_map: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        val_map[node] = graph.node_copy(node, val_map.__getitem__)
    constants = graph_info(gm).constants if KEY in gm.meta else {}
    lifted = {node.target: constants[node.target] for node in gm.graph.nodes
              if node.op == "get_attr" and node.target in constants
              and not _has_attr(model, node.target)}
    root = _with_buffers(model, lifted) if lifted else model
    bound = graph_module(root, graph, type(gm).__name__)
    bound.meta.update(gm.meta)
    bind_device(bound, next((t.device for t in model.parameters()), torch.device("cpu")))
    return bound


def _has_attr(model: nn.Module, name: str) -> bool:
    owner: object = model
    for part in name.split("."):
        if not hasattr(owner, part):
            return False
        owner = getattr(owner, part)
    return True


def _with_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]) -> nn.Module:
    """`model` seen with `buffers` (dotted name -> tensor) added, `model` itself unchanged:
    each module on a buffer's path is a shallow copy with its own module and buffer tables,
    so every parameter and other module is `model`'s own."""
    copies: dict[str, nn.Module] = {}

    def copied(path: str) -> nn.Module:  # the module at `path`, copied once
        if path not in copies:
            parent, _, part = path.rpartition(".")
            original = model.get_submodule(path)
            copies[path] = copy.copy(original)
            copies[path]._modules = dict(original._modules)
            copies[path]._buffers = dict(original._buffers)
            if path:
                copied(parent)._modules[part] = copies[path]
        return copies[path]

    for name, value in buffers.items():
        path, _, leaf = name.rpartition(".")
        copied(path)._buffers[leaf] = value
    return copied("")


def keep_tied_names(gm: fx.GraphModule, model: nn.Module) -> None:
    """Hold each tied parameter of `model` in `gm` under every one of its names.

    A graph module keeps only the attributes its graph reads, and torch.export
    reads a tied weight under one name (GPT-2's `lm_head.weight`, not
    `transformer.wte.weight`); the layout's aliases come from the names the
    graph module holds, and checkpoints and state dicts speak the model's.
    """
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    held = dict(gm.named_parameters(remove_duplicate=False))
    for group in names.values():
        present = next((n for n in group if n in held), None)
        if present is None or len(group) == 1:
            continue
        for name in group:
            if name not in held:
                owner, leaf = owner_module(gm, name)
                owner.register_parameter(leaf, held[present])
