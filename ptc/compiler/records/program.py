"""The Program: what the compiler hands the runtime.

A Program holds one lowered graph per pipeline stage (graphs are per stage,
not per rank: the dp ranks of a stage share a graph and differ only in the
shards they hold), the *layout* that says where every parameter lives, and
the reports (pass log, predicted step time, per-rank state bytes).

The layout's terms (units, shards, slots, aliases) are
`ptc.compiler.records.params`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import fx, nn

from ptc.compiler.records.graph_meta import KEY
from ptc.compiler.records.params import ADAM_STATES, MASTER_BYTES, ParamLayout
from ptc.plan import DTYPE_BYTES

if TYPE_CHECKING:
    from ptc.compiler.records.decisions import Decisions
    from ptc.compiler.records.overlap import OverlapPlan
    from ptc.compiler.records.stages import StageInfo
    from ptc.compiler.records.tp_layout import TensorParallelLayout
    from ptc.compiler.schedule.actions import Action, Schedule
    from ptc.plan import Plan


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    """One pipeline stage's lowered graph."""

    index: int
    """Pipeline stage number."""
    info: StageInfo
    """Where the stage sits in the pipeline and what crosses its edges (pp = 1: one stage)."""
    graph: fx.GraphModule
    """The lowered graph on the meta device: (tokens, targets) -> mean loss, or, split into
    pipeline stages, the calling convention of `ptc.compiler.records.stages`."""
    layout: ParamLayout
    """The stage's own parameter layout (pp = 1: the Program's), as the Decisions fix it."""
    overlap: OverlapPlan
    """The stage's buckets and overlap decisions, as the Decisions fix them (one bucket per
    unit where the comm_overlap pass did not run: `ptc.compiler.records.overlap.default_overlap`)."""


@dataclass(frozen=True, kw_only=True)
class Program:
    """A compiled plan: lowered graphs per stage, the parameter layout, and reports."""

    plan: Plan
    """The plan it was compiled from."""
    decisions: Decisions
    """The plan resolved once before the first pass: per-layer recompute policy, estimate."""
    stages: tuple[Stage, ...]
    """One lowered graph per pipeline stage."""
    layout: ParamLayout
    """Where every parameter lives (units, shards, aliases). Split into pipeline stages, the
    whole model's as captured (names and full shapes: initial values are looked up by it);
    each Stage then has its own."""
    pass_log: tuple[str, ...] = ()
    """What each pass logged, in order ("shard_params_pass: inserted 6 gather_params")."""
    schedule: Schedule
    """The pipeline schedule, checked deadlock-free (pp = 1: the one-stage schedule)."""
    actions: tuple[tuple[Action, ...], ...]
    """What each pipeline rank runs, in order: the schedule lowered to compute actions and
    the sends and receives between them (`ptc.compiler.schedule.lowering.lower`)."""
    model: nn.Module | None = None
    """The module `ptc.compile` was given (None: the plan's own model). It is what trains:
    its weights are the initial ones (unless the plan's `init` says otherwise), and the
    processes `ptc.run` starts compile it again."""

    @property
    def vocab(self) -> int | None:
        """Token ids the model takes (0 .. vocab - 1): the plan's `model.vocab`, else, for a
        custom model, the width of the logits capture found."""
        if self.plan.model.vocab is not None:
            return self.plan.model.vocab
        return self.stages[0].graph.meta[KEY].capture.vocab

    @property
    def frozen(self) -> frozenset[str]:
        """Names of the parameters the model does not train (requires_grad = False)."""
        return frozenset(self.stages[0].graph.meta[KEY].capture.frozen)

    @property
    def tensor_parallel(self) -> TensorParallelLayout | None:
        """How tp splits each parameter (None when tp = 1); the layout's shapes are tp-local."""
        return self.decisions.tensor_parallel

    @property
    def predicted_step_time(self) -> float | None:
        """The cost model's step time in seconds, when the plan was priced."""
        return self.decisions.predicted_step_time

    def state_bytes(self) -> dict[str, int]:
        """Bytes one dp rank holds between steps, per category: params, grads, optimizer, host.

        Exact for this layout (padding included): "params" are the weights the
        graph computes with (full in the compute dtype; fp32 shards at ZeRO-3),
        "grads" the gradient buffers (ZeRO 0-1: full, in `train.grad_dtype`, plus
        with a 16-bit one the fp32 copy the optimizer steps from, of what this rank
        updates; from ZeRO-2 fp32 shards), and "optimizer" the Adam moments plus a
        separate fp32 master copy when the compute dtype is not fp32 (shards from
        ZeRO-1). With optimizer offload "optimizer" is 0 and "host" holds the fp32
        master shard, its fp32 gradient and the moments (`ptc.runtime.offload`);
        otherwise "host" is 0.
        """
        zero = self.plan.parallel.zero
        full, shard = self.layout.padded_numel, self.layout.shard_numel
        compute = DTYPE_BYTES[self.plan.train.compute_dtype]
        grad = DTYPE_BYTES[self.plan.train.grad_dtype]
        moments = ADAM_STATES if self.plan.train.optimizer.name == "adamw" else \
            int(self.plan.train.optimizer.momentum > 0)
        owned = full if zero == 0 else shard  # elements this rank's optimizer updates
        if zero == 3:
            held = {"params": MASTER_BYTES * shard, "grads": MASTER_BYTES * shard,
                    "optimizer": moments * MASTER_BYTES * shard}
        else:
            master = MASTER_BYTES * owned if compute != MASTER_BYTES else 0
            main = MASTER_BYTES * owned if grad != MASTER_BYTES else 0
            held = {"params": compute * full,
                    "grads": grad * full + main if zero < 2 else MASTER_BYTES * shard,
                    "optimizer": moments * MASTER_BYTES * owned + master}
        if self.plan.parallel.offload == "none":
            return {**held, "host": 0}
        return {**held, "optimizer": 0, "host": (moments + 2) * MASTER_BYTES * owned}
