"""Sequence parallelism's saved activations: keep the local chunk, all-gather again in backward.

Under sequence parallelism a column-parallel linear reads the output of
`all_gather_seq`, the full sequence, and autograd would keep that full
tensor for the weight gradient — undoing the 1/tp saving of the region
before it. As Megatron-LM does, the session's saved-tensor hooks keep only
the rank's chunk (the all-gather's input) in its place and gather again on
the first unpack in backward; q, k and v, which save the same gathered
tensor, share one re-gather, dropped when `all_gather_seq`'s own backward
runs (every user of the gathered tensor is done by then).

Terms: a *gathered* tensor is an output of `all_gather_seq` made while a
session is current; its *chunk* is the input it was gathered from.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from ptc.ops.session import Session

def current_session() -> SeqRegather | None:
    """The session of the forward being run, if any (read by `all_gather_seq`)."""
    return SeqRegather.current()


@contextmanager
def no_session() -> Iterator[None]:
    """Run without the current session: what a checkpoint region runs under, in forward
    and in its recompute alike (which runs in backward, without a session), so that what
    reads the session (a float8 linear, `ptc.ops.fp8_linear`) saves the same both times."""
    outer = SeqRegather.swap(None)
    try:
        yield
    finally:
        SeqRegather.swap(outer)


class _SeqRef:
    """A saved view of a gathered tensor, kept as its chunk and the view's geometry."""

    __slots__ = ("key", "chunk", "gather", "offset", "size", "stride")

    def __init__(self, key: int, chunk: torch.Tensor,
                 gather: Callable[[torch.Tensor], torch.Tensor], offset: int, size, stride):
        self.key, self.chunk, self.gather = key, chunk, gather
        self.offset, self.size, self.stride = offset, size, stride


class SeqRegather(Session):
    """Saved-tensor hooks that store gathered sequence activations as their local chunk."""

    def __init__(self) -> None:
        # key -> (the gathered tensor, its chunk, the gather that made it from the chunk)
        self._live: dict[int, tuple[weakref.ref, torch.Tensor,
                                    Callable[[torch.Tensor], torch.Tensor]]] = {}
        self._full: dict[int, torch.Tensor] = {}  # key -> re-gathered tensor, until released

    def track(self, out: torch.Tensor, chunk: torch.Tensor,
              gather: Callable[[torch.Tensor], torch.Tensor]) -> int:
        """Remember that `out` was gathered from `chunk` by `gather` (which gathers any
        tensor laid out as `chunk` the same way). Returns its key.

        Only while `out` lives: what saved it holds its own `_SeqRef` (chunk and
        gather), and a gathered tensor nothing saved (a float8 linear's input, of
        which it keeps its own float8 chunk) must not keep its chunk alive."""
        key = id(out)
        self._live[key] = (weakref.ref(out, lambda _, key=key: self._forget(key)), chunk, gather)
        return key

    def gathered(self, tensor: torch.Tensor
                 ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]] | None:
        """(chunk, gather) of a tensor this session gathered, while it lives; else None. A
        float8 linear keeps the float8 copy of the chunk and gathers that in backward."""
        entry = self._live.get(id(tensor))
        if entry is None or entry[0]() is not tensor:  # not gathered (or a stale id)
            return None
        return entry[1], entry[2]

    def chunks(self) -> list[torch.Tensor]:
        """The chunks the session holds now (of the gathered tensors still alive)."""
        return [entry[1] for entry in self._live.values()]

    def _forget(self, key: int) -> None:
        """`out` of `key` is gone: nothing can save it any more."""
        self._live.pop(key, None)

    def release(self, key: int) -> None:
        """Drop the re-gathered tensor of `key`: backward is done with it."""
        self._full.pop(key, None)
        self._live.pop(key, None)

    def pack(self, tensor: torch.Tensor):
        """Saved-tensor pack hook: a gathered tensor (or a view of one) becomes a `_SeqRef`."""
        base = tensor._base if tensor._base is not None else tensor
        found = self.gathered(base)
        if found is None:
            return tensor
        chunk, gather = found
        return _SeqRef(id(base), chunk, gather, tensor.storage_offset() - base.storage_offset(),
                       tensor.size(), tensor.stride())

    def unpack(self, saved):
        """Saved-tensor unpack hook: gather a `_SeqRef` again (once per gathered tensor)."""
        if not isinstance(saved, _SeqRef):
            return saved
        full = self._full.get(saved.key)
        if full is None:
            full = self._full[saved.key] = saved.gather(saved.chunk)
        return full.as_strided(saved.size, saved.stride, full.storage_offset() + saved.offset)

    def hooks(self, inner: torch.autograd.graph.saved_tensors_hooks | None = None):
        """The saved-tensor hooks to run forward under, chained with `inner`'s (ZeRO-3's)."""
        if inner is None:
            return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

        def pack(tensor):
            mine = self.pack(tensor)
            return mine if mine is not tensor else inner.pack_hook(tensor)

        def unpack(saved):
            return self.unpack(saved) if isinstance(saved, _SeqRef) else inner.unpack_hook(saved)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def forward_context(regather: SeqRegather | None,
                    inner: torch.autograd.graph.saved_tensors_hooks | None = None):
    """What to run a forward under: the session and its hooks, else just `inner` (or nothing)."""
    if regather is None:
        return inner if inner is not None else nullcontext()
    return _Both(regather, regather.hooks(inner))


class _Both(AbstractContextManager):
    def __init__(self, session: SeqRegather, hooks) -> None:
        self.session, self.hooks = session, hooks

    def __enter__(self):
        self.session.__enter__()
        self.hooks.__enter__()
        return self.session

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)
        self.session.__exit__(*exc)
