"""Activation recompute: run a region of the graph under torch's checkpoint.

The activation_checkpoint pass (ptc/passes/checkpoint_layers.py) moves
what a layer's policy recomputes (`ptc.compiler.graph.recompute_regions`: the layer for
"full" and "ops", its attention core for "selective", the named modules for
`modules(...)`) into a small GraphModule and calls it through
`checkpoint_region`. A *saving* region keeps the outputs of its matmuls
(`SAVED_OPS`) through torch's selective activation checkpointing, and
recomputes only the ops between them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, \
    create_selective_checkpoint_contexts

from ptc.ops.dropout import current_samples, dropout_samples
from ptc.ops.seq_regather import no_session
from ptc.ops import fp8_linear  # noqa: F401 - registers torch.ops.ptc.fp8_gemm


_aten = torch.ops.aten
SAVED_OPS = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.ptc.fp8_gemm.default,
})
"""The ops whose outputs a saving region keeps: the matmuls a linear or a matmul of
activations runs as (a float8 linear's GEMM among them), and the fused attention kernels
(output and log-sum-exp)."""


def save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing's policy of a saving region: keep `SAVED_OPS`' outputs."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _saving_contexts():
    return create_selective_checkpoint_contexts(save_matmuls_policy)


def checkpoint_region(region: torch.nn.Module, *inputs: Any, save_matmuls: bool = False) -> Any:
    """Run `region(*inputs)` keeping only its inputs; backward recomputes the region's forward.

    Forward runs the region without saving its intermediate activations
    (torch.utils.checkpoint, use_reentrant=False); the backward pass reruns
    the region's forward to rebuild them, then differentiates through it.
    The recomputation draws the forward's dropout masks: the samples they are
    keyed by (`ptc.ops.dropout`) are kept for it, and torch's checkpoint
    restores the RNG state for any other random op. Outside autograd (no
    tensor input needs grad, or grad mode off) the region just runs.

    `save_matmuls`: also keep the outputs of the region's matmuls and
    attention kernels (`SAVED_OPS`), torch's selective activation
    checkpointing; backward then reruns only the ops between them (each
    matmul's backward still sees its recomputed inputs).
    """
    if not torch.is_grad_enabled():
        return region(*inputs)
    samples = current_samples()

    def run(*args: Any) -> Any:
        with dropout_samples(samples), no_session():
            return region(*args)

    if save_matmuls:
        return checkpoint(run, *inputs, use_reentrant=False, preserve_rng_state=True,
                          context_fn=_saving_contexts)
    return checkpoint(run, *inputs, use_reentrant=False, preserve_rng_state=True)


def invoke_module(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call `module(*args, **kwargs)`: how a region calls a parameter-free module of the graph.

    The module (dropout, an activation) stays owned by the outer graph, so
    train()/eval() and submodule clean-up see it; backward is the module's.
    """
    return module(*args, **kwargs)
