"""Bytes each graph node saves for backward, read off the graph by running it on meta.

The captured graph is interpreted node by node on the meta device with
autograd on and a `saved_tensors_hooks` pack hook: whatever torch's own
autograd formulas save for backward is seen as it is saved, with its storage.
Nothing is allocated and no formula of ours guesses what an op keeps.

Terms:
- a *saved storage* is one storage that some saved tensor views; views of
  one storage (q, k, v split from one qkv output) count once, at the storage's
  size — what the caching allocator really holds;
- its *producer* is the node whose output first had that storage, or, for a
  tensor made inside an op (a dropout mask, a norm's mean and rstd), the node
  that saved it;
- parameters and buffers saved for backward (a linear's weight, a RoPE table)
  are model state, not activations, and are skipped;
- a *held* storage is the output of a node that a checkpoint region would
  read as its input (`saved_storages`' `held`): torch's checkpoint keeps it
  whether or not any backward formula saves it.

Two ops run as their fused GPU kernels do, since GPUs are what the memory
model is for, where meta would take torch's composite fallback: attention
through `scaled_dot_product_attention` as flash attention (it saves q, k, v,
its output — laid out [b, s, heads, d] as flash kernels write it, so the
usual transpose-and-reshape after it is a view — and the fp32 log-sum-exp,
never the s x s scores), and dropout as CUDA's fused kernel, keeping a 1-byte
mask (off CUDA torch keeps a mask in the input's dtype). Everything else,
RMSNorm included, saves what torch's own kernels save.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
import torch.fx
from torch.nn import functional as F

from ptc.ops.dropout import site_dropout


@dataclass(frozen=True, slots=True)
class SavedStorage:
    """One storage kept for backward."""

    producer: str
    """Name of the node whose output (or internal tensor) the storage is."""
    internal: bool
    """True for a tensor made inside the producer op (mask, statistics), not its output."""
    savers: tuple[str, ...]
    """Nodes whose backward keeps it (none for a held storage that nothing saves)."""
    nbytes: int
    """Size of the storage in bytes."""
    held: bool = False
    """An output of a node named in `saved_storages`' `held`."""
    key: int = 0
    """Identity of the storage within one run (`output_storages` names the same ones)."""
    floating: bool = True
    """Its values are floating-point, not indices or a grouped product's offsets: what a
    float8 GEMM keeps a float8 copy of (`ptc.compiler.profile.fp8`)."""


class _FlashAttention(torch.autograd.Function):
    """Meta stand-in for flash attention: the output, saving what the kernel saves."""

    @staticmethod
    def forward(ctx, q, k, v):  # noqa: D102 - autograd.Function protocol
        if q.dim() == 4:
            b, heads, sq = q.shape[:3]
            out = q.new_empty(b, sq, heads, v.shape[-1]).transpose(1, 2)
        else:
            out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102 - never run: we only count what forward saves
        raise NotImplementedError("meta stand-in: backward is not executed")


class _FusedDropout(torch.autograd.Function):
    """Meta stand-in for CUDA's fused dropout: the output, saving a 1-byte mask."""

    @staticmethod
    def forward(ctx, x):  # noqa: D102 - autograd.Function protocol
        ctx.save_for_backward(torch.empty(x.shape, dtype=torch.bool, device=x.device))
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102 - never run: we only count what forward saves
        raise NotImplementedError("meta stand-in: backward is not executed")


DROPOUT_TARGETS = (F.dropout, torch.dropout, torch.ops.aten.dropout.default, site_dropout)
_SDPA_TARGETS = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)


class _SavedRecorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, model_storages: set[int]):
        super().__init__(gm, garbage_collect_values=False)
        self.model_storages = model_storages
        self.current = ""
        self.producer: dict[int, str] = {}
        self.saved: dict[int, tuple[int, list[str]]] = {}
        self.floating: dict[int, bool] = {}
        self.keep: list[torch.Tensor] = []  # keeps storages alive so their keys stay unique

    def run_node(self, n: torch.fx.Node):
        self.current = n.name
        out = super().run_node(n)
        for t in _tensors(out):
            self.producer.setdefault(_key(t), n.name)
            self.keep.append(t)
        return out

    def call_function(self, target, args, kwargs):
        if target in _SDPA_TARGETS and _flash_applies(args, kwargs):
            return _FlashAttention.apply(*args[:3])
        if target in DROPOUT_TARGETS and dropout_active(args, kwargs):
            return _FusedDropout.apply(args[0])
        return super().call_function(target, args, kwargs)

    def call_module(self, target, args, kwargs):
        mod = self.fetch_attr(target)
        if isinstance(mod, torch.nn.Dropout) and mod.training and mod.p > 0:
            return _FusedDropout.apply(args[0])
        return super().call_module(target, args, kwargs)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        if key not in self.model_storages:
            nbytes, savers = self.saved.setdefault(key, (t.untyped_storage().nbytes(), []))
            if self.current not in savers:
                savers.append(self.current)
            self.floating[key] = t.is_floating_point()
            self.keep.append(t)
        return t


def _flash_applies(args: Sequence, kwargs: dict) -> bool:
    """Whether a fused kernel that keeps no s x s scores runs it: flash without a mask, the
    memory-efficient kernel with one (it reads the mask, a tensor of its own); not with
    dropout."""
    dropout = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
    return not dropout


def dropout_active(args: Sequence, kwargs: dict) -> bool:
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    train = args[2] if len(args) > 2 else kwargs.get("train", kwargs.get("training", True))
    return bool(train) and p > 0


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def saved_storages(gm: torch.fx.GraphModule, inputs: Sequence[torch.Tensor],
                   held: Collection[str] = ()) -> list[SavedStorage]:
    """`saved_and_output_storages` without the outputs."""
    return saved_and_output_storages(gm, inputs, held)[0]


def saved_and_output_storages(gm: torch.fx.GraphModule, inputs: Sequence[torch.Tensor],
                              held: Collection[str] = ()
                              ) -> tuple[list[SavedStorage],
                                         dict[str, dict[int, tuple[int, str]]]]:
    """Every storage the forward of `gm` saves for backward, on the meta device, and the
    storages of the outputs of the nodes named in `held` (marked `held`, with no savers
    when nothing saves them): what a checkpoint region reading them would keep.

    `gm`'s parameters must be meta tensors (a captured graph's are); `inputs`
    are meta tensors of the placeholders' shapes. Second: per node, the
    storages of its outputs that are not model state ({key: (bytes, producer)},
    keys as `SavedStorage.key`): what a checkpoint reading that node keeps.
    """
    model_storages = {_key(t) for t in (*gm.parameters(), *gm.buffers())}
    rec = _SavedRecorder(gm, model_storages)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
        rec.run(*inputs)
    held_sizes = {_key(t): t.untyped_storage().nbytes() for n in gm.graph.nodes if n.name in held
                  for t in _tensors(rec.env[n]) if _key(t) not in model_storages}
    out = []
    for key, (nbytes, savers) in rec.saved.items():
        producer = rec.producer.get(key)
        out.append(SavedStorage(producer=producer or savers[0], internal=producer is None,
                                savers=tuple(savers), nbytes=nbytes, held=key in held_sizes,
                                key=key, floating=rec.floating[key]))
    out += [SavedStorage(producer=rec.producer[key], internal=False, savers=(), nbytes=nbytes,
                         held=True, key=key)
            for key, nbytes in held_sizes.items() if key not in rec.saved]
    outputs = {n.name: {_key(t): (t.untyped_storage().nbytes(), rec.producer[_key(t)])
                        for t in _tensors(rec.env[n])
                        if _key(t) not in model_storages}
               for n in gm.graph.nodes if n in rec.env}
    return out, outputs
