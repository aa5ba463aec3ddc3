"""`Session`: a context whose one entered instance the ops read while a graph runs.

A ZeRO-3 gather finds its `ParamSession` (`ptc.ops.zero3`), a sequence
all-gather its `SeqRegather` (`ptc.ops.seq_regather`), without the graph
passing them as arguments. Each kind of session has one slot of its own,
set on entry and cleared on exit. A class attribute, not a contextvar:
backward may run on autograd's own threads, which must see the session the
forward entered.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import ClassVar, TypeVar

S = TypeVar("S", bound="Session")


class Session(AbstractContextManager):
    """Entered, the one current instance of its class (`current`) until it exits."""

    _current: ClassVar[Session | None] = None

    def __enter__(self: S) -> S:
        type(self)._current = self
        return self

    def __exit__(self, *exc) -> None:
        type(self)._current = None

    @classmethod
    def current(cls: type[S]) -> S | None:
        """The entered session of this class, if any."""
        return cls._current

    @classmethod
    def swap(cls: type[S], session: S | None) -> S | None:
        """Make `session` the current one; return the one it replaces."""
        outer, cls._current = cls._current, session
        return outer
