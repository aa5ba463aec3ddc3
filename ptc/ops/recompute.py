"""Activation recompute: run a region of the graph under torch's checkpoint.

The activation_checkpoint pass (ptc/passes/activation_checkpoint.py) moves a
layer (policy "full") or its attention core (policy "selective") into a
small GraphModule and calls it through `checkpoint_region`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


def checkpoint_region(region: torch.nn.Module, *inputs: Any) -> Any:
    """Run `region(*inputs)` keeping only its inputs; backward recomputes the region's forward.

    Forward runs the region without saving its intermediate activations
    (torch.utils.checkpoint, use_reentrant=False); the backward pass reruns
    the region's forward to rebuild them, then differentiates through it.
    RNG state is saved and restored by torch's checkpoint, so dropout masks
    of the recomputation match those of the forward. Outside autograd
    (no tensor input needs grad, or grad mode off) the region just runs.
    """
    if not torch.is_grad_enabled():
        return region(*inputs)
    return checkpoint(region, *inputs, use_reentrant=False, preserve_rng_state=True)


def invoke_module(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call `module(*args, **kwargs)`: how a region calls a parameter-free module of the graph.

    The module (dropout, an activation) stays owned by the outer graph, so
    train()/eval() and submodule clean-up see it; backward is the module's.
    """
    return module(*args, **kwargs)
