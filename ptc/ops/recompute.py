"""Activation recompute: run a region of the graph under torch's checkpoint.

The activation_checkpoint pass (ptc/passes/checkpoint_layers.py) moves
what a layer's policy recomputes (`ptc.compiler.graph.recompute_regions`: the layer for
"full" and "ops", its attention core for "selective", the named modules for
`modules(...)`) into a small GraphModule and calls it through
`checkpoint_region`. A *saving* region keeps the outputs of its matmuls
(`SAVED_OPS`) through torch's selective activation checkpointing, and
recomputes only the ops between them.

Under a split backward (`recompute_once`: zero-bubble schedules run a stage's backward
as I, then W, in separate autograd calls) torch's checkpoint would recompute a region
once per autograd call that reads it: in I, and again in each of W's calls. There a
region runs through `_Recomputed` instead: its saved tensors are rebuilt once, at the
first read, and each is dropped after the last node that reads it has read it — the
nodes I runs for the weights' sake (the branch nodes of `ptc.runtime.split_backward`)
read theirs again in W, so while they run in I their reads keep what they read
(`keeping_reads`).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, \
    create_selective_checkpoint_contexts

from ptc.ops.dropout import current_samples, dropout_samples
from ptc.ops.seq_regather import no_session
from ptc.ops import fp8_grouped, fp8_linear  # noqa: F401 - register torch.ops.ptc's GEMMs


_aten = torch.ops.aten
SAVED_OPS = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.ptc.fp8_gemm.default, torch.ops.ptc.fp8_grouped_gemm.default,
})
"""The ops whose outputs a saving region keeps: the matmuls a linear or a matmul of
activations runs as (a float8 linear's GEMM and a float8 grouped product among them), and
the fused attention kernels (output and log-sum-exp)."""
GROUPED_PRODUCTS = frozenset({"_grouped_mm", "grouped_mm_fallback"})
"""Routed experts' grouped products, kept as the matmuls are: torch's and transformers'
fallback (an op of a library registered when it is imported, so matched by name)."""


def save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing's policy of a saving region: keep `SAVED_OPS`' outputs and
    the grouped products'."""
    kept = op in SAVED_OPS or getattr(op, "overloadpacket", op).__name__ in GROUPED_PRODUCTS
    return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE


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

    if _ONCE.get():
        return _Recomputed(run, inputs, save_matmuls).forward(*inputs)
    if save_matmuls:
        return checkpoint(run, *inputs, use_reentrant=False, preserve_rng_state=True,
                          context_fn=_saving_contexts)
    return checkpoint(run, *inputs, use_reentrant=False, preserve_rng_state=True)


_ONCE: contextvars.ContextVar[bool] = contextvars.ContextVar("ptc_recompute_once",
                                                             default=False)
_READS = threading.local()  # autograd runs a node's hooks and its body on one thread


@contextlib.contextmanager
def recompute_once() -> Iterator[None]:
    """Within: checkpointed regions are recomputed once per forward, whatever autograd
    calls read them (module docstring); for stages whose backward is split into I and W."""
    token = _ONCE.set(True)
    try:
        yield
    finally:
        _ONCE.reset(token)


def keeping_reads(keep: bool) -> None:
    """Whether the saved tensors autograd reads from now on, on this thread, are read again
    later (a branch node's in I: W reads them again), so stay kept after the read."""
    _READS.keep = keep


class _Recomputed:
    """One call of a checkpointed region whose saved tensors are rebuilt once: the forward
    keeps none but its inputs (and, for a saving region, its matmuls' outputs); the first
    read reruns the forward with the same random state and keeps all it saves; each read
    hands one over and drops it, unless `keeping_reads` says it will be read again."""

    def __init__(self, run: Callable[..., Any], inputs: tuple, save_matmuls: bool):
        self.run, self.save_matmuls = run, save_matmuls
        self.inputs = [x.detach() if isinstance(x, torch.Tensor) else x for x in inputs]
        self.grads = [isinstance(x, torch.Tensor) and x.requires_grad for x in inputs]
        self.devices = sorted({x.device.index for x in inputs
                               if isinstance(x, torch.Tensor) and x.is_cuda})
        self.rng = torch.get_rng_state()
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.devices]
        self.saved: list[torch.Tensor | None] | None = None
        self.count = 0
        self.contexts = _saving_contexts() if save_matmuls else None

    def forward(self, *inputs: Any) -> Any:
        """Run the region on `inputs`, each tensor it saves replaced by its index."""
        def pack(_: torch.Tensor) -> tuple[_Recomputed, int]:
            self.count += 1
            return self, self.count - 1

        with torch.autograd.graph.saved_tensors_hooks(pack, _read), \
                self.contexts[0] if self.contexts else contextlib.nullcontext():
            return self.run(*inputs)

    def inputs_for_autograd(self) -> list:
        """The inputs as leaves of a graph of their own (those that needed a gradient), for
        the recomputation."""
        return [x.detach().requires_grad_(g) if isinstance(x, torch.Tensor) else x
                for x, g in zip(self.inputs, self.grads)]

    def recompute(self) -> None:
        """Rerun the forward from the inputs with the forward's random state; keep what it
        saves, in the order it saves them (the forward's order: the same ops run)."""
        saved: list[torch.Tensor | None] = []

        def keep(tensor: torch.Tensor) -> int:
            saved.append(tensor)
            return len(saved) - 1

        with torch.random.fork_rng(devices=self.devices), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(keep, saved.__getitem__), \
                self.contexts[1] if self.contexts else contextlib.nullcontext():
            torch.set_rng_state(self.rng)
            for device, state in zip(self.devices, self.cuda_rng):
                torch.cuda.set_rng_state(state, device)
            self.run(*self.inputs_for_autograd())
        if len(saved) != self.count:
            raise RuntimeError(f"a checkpointed region saved {self.count} tensors in its "
                               f"forward but {len(saved)} when recomputed")
        self.saved = saved


def _read(packed: tuple[_Recomputed, int]) -> torch.Tensor:
    """Unpack hook of `_Recomputed`: the saved tensor, recomputing the region first."""
    region, index = packed
    if region.saved is None:
        region.recompute()
    tensor = region.saved[index]
    if tensor is None:
        raise RuntimeError("a checkpointed region's saved tensor was read after its last "
                           "read (a backward ran twice through it)")
    if not getattr(_READS, "keep", False):
        region.saved[index] = None
    return tensor


def invoke_module(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call `module(*args, **kwargs)`: how a region calls a parameter-free module of the graph.

    The module (dropout, an activation) stays owned by the outer graph, so
    train()/eval() and submodule clean-up see it; backward is the module's.
    """
    return module(*args, **kwargs)
