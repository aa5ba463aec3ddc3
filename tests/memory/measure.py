"""What a run really keeps for backward: the pieces the memory tests count.

Beside what autograd saves (`saved_tensors_hooks`, which also see the
inputs torch's checkpoint keeps for a region), a saving region's selective
checkpoint caches its matmuls' outputs in a store of its own:
`cached_by_regions` shows those to a counting function. The runtime binds
floating buffers as the model made them (fp32), whatever the compute dtype:
`as_runtime_holds` and `buffers_as_built` make a test's model or graph hold
them so. Shared by the single-process tests
(tests/passes/test_activation_checkpoint.py, tests/memory/) and the
tensor-parallel workers (tests/distributed/tp_helpers.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy

from ptc.ops import recompute as recompute_ops


@contextlib.contextmanager
def cached_by_regions(note: Callable[[torch.Tensor], None]):
    """Call `note` on every tensor a saving region's selective checkpoint caches in forward
    (`ptc.ops.recompute.save_matmuls_policy` deciding MUST_SAVE): what it keeps besides."""
    original = recompute_ops.save_matmuls_policy

    def policy(ctx, op, *args, **kwargs):
        decision = original(ctx, op, *args, **kwargs)
        if decision == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
            for t in pytree.tree_leaves(ctx.op_output):
                if isinstance(t, torch.Tensor):
                    note(t)
        return decision

    recompute_ops.save_matmuls_policy = policy
    try:
        yield
    finally:
        recompute_ops.save_matmuls_policy = original


def as_runtime_holds(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` with its floating parameters in `dtype` and its buffers as built, as the runtime
    binds them (`ptc.runtime.init.initial_buffers`): a RoPE table is cast where it is used."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    return model


def buffers_as_built(gm: nn.Module) -> nn.Module:
    """`gm` (a compiled graph, pipeline or region) with its floating buffers in float32, the
    dtype the built-in models make them in and the runtime binds them at."""
    for mod in gm.modules():
        for name, buf in mod._buffers.items():
            if buf is not None and buf.is_floating_point():
                mod._buffers[name] = buf.float()
    return gm


def kept_norm_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """LayerNorm nodes of `gm` outside its recompute regions (a module call or a functional
    one): the norms whose statistics backward keeps."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), nn.LayerNorm):
            out.append(n)
        elif n.op == "call_function" and n.target in (torch.nn.functional.layer_norm,
                                                      torch.ops.aten.layer_norm.default):
            out.append(n)
    return out
