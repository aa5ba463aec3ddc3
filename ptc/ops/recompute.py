"""Activation recompute: run a region of the graph under torch's checkpoint.

The activation_checkpoint pass (ptc/passes/activation_checkpoint.py) moves a
layer (policy "full") or its attention core (policy "selective") into a
small GraphModule and calls it through `checkpoint_region`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ptc.ops.dropout import current_samples, dropout_samples


def checkpoint_region(region: torch.nn.Module, *inputs: Any) -> Any:
    """Run `region(*inputs)` keeping only its inputs; backward recomputes the region's forward.

    Forward runs the region without saving its intermediate activations
    (torch.utils.checkpoint, use_reentrant=False); the backward pass reruns
    the region's forward to rebuild them, then differentiates through it.
    The recomputation draws the forward's dropout masks: the samples they are
    keyed by (`ptc.ops.dropout`) are kept for it, and torch's checkpoint
    restores the RNG state for any other random op. Outside autograd (no
    tensor input needs grad, or grad mode off) the region just runs.
    """
    if not torch.is_grad_enabled():
        return region(*inputs)
    samples = current_samples()

    def run(*args: Any) -> Any:
        with dropout_samples(samples):
            return region(*args)

    return checkpoint(run, *inputs, use_reentrant=False, preserve_rng_state=True)


def invoke_module(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call `module(*args, **kwargs)`: how a region calls a parameter-free module of the graph.

    The module (dropout, an activation) stays owned by the outer graph, so
    train()/eval() and submodule clean-up see it; backward is the module's.
    """
    return module(*args, **kwargs)
