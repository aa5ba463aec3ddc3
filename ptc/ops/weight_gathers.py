"""ZeRO-1/2's weight all-gathers, waited for where the next forward first reads each unit.

After the optimizer step each data-parallel rank holds the new weights of
its 1/dp of every unit; `ptc.runtime.params.publish` all-gathers them into
the full buffers the graph reads. Waited for at the end of the step, that
traffic is exposed. Megatron-LM's `--overlap-param-gather` waits for a
bucket's gather only when the next forward reaches it; ptc does the same in
the graph: the overlap pass puts `await_weights(stage, unit)` before the
first node of a stage graph that reads a unit's weights, the runtime
registers each gather it leaves in flight (`expect`), and the node waits for
that one alone. Unit 0's gather then hides behind nothing, unit k's behind
the forward of units 0..k-1.

Anything else that reads the weights waits for all of them first
(`settle`): the trainer does before its next optimizer step, the training
loop before a checkpoint, a snapshot or the end of the run. With nothing
registered (a graph run by hand, the first step, a trainer that waited)
the node does nothing.
"""

from __future__ import annotations

import torch

from ptc.ops.comm import Waitable

_PENDING: dict[tuple[int, int], Waitable] = {}
"""(stage, unit index in the stage's layout) -> its weight gather in flight."""


def expect(stage: int, unit: int, work: Waitable) -> None:
    """Register the gather of `unit`'s weights of `stage`, left in flight."""
    _PENDING[(stage, unit)] = work


def settle() -> int:
    """Wait for every weight gather still in flight; returns how many there were."""
    works = list(_PENDING.values())
    _PENDING.clear()
    for work in works:
        work.wait()
    return len(works)


def pending() -> int:
    """Weight gathers registered and not yet waited for."""
    return len(_PENDING)


@torch.compiler.disable
def await_weights(stage: int, unit: int) -> None:
    """Forward: wait for the gather of `unit`'s weights of `stage` if one is in flight (see
    the module docstring); no gradient, no output. Backward: nothing."""
    work = _PENDING.pop((stage, unit), None)
    if work is not None:
        work.wait()


await_weights.ptc_collective = ("wait for the unit's weight all-gather", "none")
