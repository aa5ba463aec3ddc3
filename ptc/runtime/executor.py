"""The one trainer: a rank's training step over its part of a Program, every layout.

Terms: p pipeline ranks, v chunks per rank, m micro-batches per step. The
rank holds the stage graphs s = chunk·p + rank (`ptc.compiler.records.stages` says
what each takes and gives); pp = 1 is one stage, p = v = 1. Each graph runs
through `GraphRunner`, which turns any failure into a `RankError` naming the
rank, the graph node and the user's source line.

A step runs the rank's part of the Program's schedule (`ptc.compiler.schedule`,
lowered with sends and receives), action by action, through a table from
action kind to handler:

- RECV_F / RECV_B post the receives of a stage's input activations / of
  the gradients of its outputs (asynchronous: the transfer overlaps the
  compute actions before the one that waits for it);
- F runs the stage graph on the received activations — made autograd
  leaves — and the micro-batch's tokens / targets, which every rank reads
  itself; the inputs and outputs stay alive until the micro-batch's B;
- SEND_F sends the outputs, SEND_B the gradients of the inputs
  (asynchronous; a sent tensor is dropped as soon as its send completes);
- B runs backward from the received gradients (the last stage: from
  loss / (m·dp), so that gradient sums over micro-batches and ranks are the
  global-batch mean) and drops the micro-batch's activations at once;
- I and W, a zero-bubble schedule's B in two (`ptc.runtime.split_backward`):
  I computes the gradients of the stage's inputs, which SEND_B sends, W later
  those of its weights; the micro-batch's activations stay until its W.

What every layout shares lives here once: gradient reduction overlapped with
backward (ZeRO 0-2: `GradReducer` per stage, its "last micro-batch" the
stage's last B of the step; ZeRO-3: the graph's `gather_params` under a
`ParamSession` per stage and micro-batch), the sequence-parallel regather of
gathered activations around each forward, the sums after the last action
(tied weights between the stages holding them, sequence-partial gradients
over tp), the NaN guard (one all-reduce over the job; none when the job is
pure data parallel at ZeRO-0, whose gradient all-reduce carries it:
`FoldedGuard`), which also sums the ranks' parts of the squared gradient norm
for the global-norm clip (each element counted once, a tied weight once:
`ShardedOptimizer.norm_share`),
the update of the rank's masters and the publishing of the
new weights (with optimizer offload: on the host, unit by unit, its copies
pipelined with the CPU's step; `ptc.runtime.offload`). Under
tensor parallelism the graphs hold the rank's tp-local slices
(`ptc.runtime.tp_state`) and run their own tp collectives.

The rank counts its in-flight stage micro-batches (forwarded, not yet
backwarded) and keeps the peak in `peak_in_flight`: the number the memory
model's `in_flight` charges activations for.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import fx, nn

from ptc.compiler.graph.devices import bind_device
from ptc.compiler.graph.lazy_code import with_code
from ptc.compiler.graph.meta import get_info
from ptc.compiler.records.overlap import OverlapPlan
from ptc.compiler.records.params import COMPUTE_DTYPES, ParamSlot, ShardUnit
from ptc.compiler.records.program import Program
from ptc.compiler.schedule.actions import Action
from ptc.compiler.records.stages import StageInfo
from ptc.errors import PtcError
from ptc.ops.expert_parallel import RoutedTokens
from ptc.ops.comm import (all_gather_flat, all_reduce_flat, bind_axes, comm_wait_seconds,
                          group_rank, group_size)
from ptc.ops import weight_gathers
from ptc.ops.dropout import Samples, dropout_samples
from ptc.ops.fp8_linear import advance_amax_history
from ptc.ops.recompute import recompute_once
from ptc.ops.seq_regather import SeqRegather, forward_context
from ptc.ops.zero3 import ParamSession
from ptc.runtime import faults
from ptc.runtime.data import TokenSource, microbatch_start
from ptc.runtime.grads import GradReducer
from ptc.runtime.health import FoldedGuard, guarded_update
from ptc.runtime.init import ModelFactory, initial_buffers, reference_model
from ptc.runtime.lr import learning_rate
from ptc.runtime.split_backward import WeightBackward, input_backward
from ptc.runtime.mesh import timeout
from ptc.runtime.offload import HostOptimizer, offload_masters
from ptc.runtime.optimizer import ShardedOptimizer
from ptc.runtime.p2p import Transfer, post_recv, send
from ptc.runtime.params import (Placement, UnitState, bind_buffers, build_units, drop_grads,
                                fill_main_grads, held_bytes, publish, slot_ranges)
from ptc.runtime.tp_state import (join_over_tp, partial_grad_ranges, rank_values, replicated_ranges,
                                  seed_dropout, sum_partial_grads)


class RankError(PtcError):
    """A rank failed; the message names the rank, the graph node and the user's source line."""


def source_line(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """Where in the user's code `node` comes from ("file.py:12"), as well as known."""
    info = get_info(node)
    if info is not None and info.source:
        return info.source
    trace = node.meta.get("stack_trace")
    if trace:
        frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
        if frames:
            return f"{frames[-1][0]}:{frames[-1][1]}"
    path = info.module_path if info is not None else (
        str(node.target) if node.op == "call_module" else None)
    if path:
        try:
            module = gm.get_submodule(path)
            _, start = inspect.getsourcelines(type(module).forward)
            return f"{inspect.getsourcefile(type(module))}:{start} ({path})"
        except (AttributeError, OSError, TypeError):
            return f"module {path}"
    return None


_DOING = {"F": "forward of", "B": "backward of", "I": "input gradients of",
          "W": "weight gradients of", "RECV_F": "receiving the input of",
          "SEND_F": "sending the output of", "RECV_B": "receiving the output gradient of",
          "SEND_B": "sending the input gradient of"}
"""What a rank is doing in each kind of schedule action, for messages."""


def located(exc: Exception, rank: int, step: int, action) -> RankError:
    """`exc`, raised by `action` of step `step` (0-based), as a RankError whose second line says
    where in the step: `at step 3, micro-batch 1, forward of stage 0`."""
    kind = "" if isinstance(exc, PtcError) else f"{type(exc).__name__}: "  # ptc's say enough
    text = str(exc) if isinstance(exc, RankError) else f"rank {rank}: {kind}{exc}"
    first, _, rest = text.partition("\n")
    return RankError("\n".join(filter(None, (first, f"  at step {step + 1}, {doing(action)}",
                                               rest))))


def doing(action) -> str:
    """What `action` does, in words: `micro-batch 1, forward of stage 0`."""
    return (f"micro-batch {action.microbatch}, {_DOING.get(action.kind, action.kind)} "
            f"stage {action.stage}")


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`; to a GPU through pinned memory, so the copy runs asynchronously
    (ordered on the compute stream) instead of blocking the step's Python thread."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class GraphRunner:
    """Runs a lowered graph and turns any failure into a RankError naming the node.

    The graph's generated code runs directly, without fx.Interpreter's
    per-node cost (it doubles the forward time of a small model). When it
    raises, the traceback's frame in that code gives the line, and the graph
    module's line map the node: the report fx.Interpreter's "While executing"
    would give.
    """

    def __init__(self, gm: fx.GraphModule, rank: int, *, compiled: bool = False):
        """`compiled`: run the graph through `torch.compile` (runtime.compile)."""
        self.gm, self.rank, self.compiled = with_code(gm), rank, compiled
        self._code = gm.forward.__func__.__code__
        self._nodes = list(gm.graph.nodes)
        # not gm(...): fx's wrapper drops the traceback that names the failing node
        self._forward = torch.compile(gm.forward) if compiled else gm.forward

    def run(self, *args: torch.Tensor):
        """The graph's output for `args`."""
        try:
            return self._forward(*args)
        except Exception as exc:
            node = self.failing_node(exc)
            where = source_line(self.gm, node) if node is not None else None
            hint = ("\n  (a compiled graph: without runtime.compile the error names its node)"
                    if self.compiled and node is None else "")
            raise RankError(f"rank {self.rank}: {type(exc).__name__}: {exc}"
                            + (f"\n  while executing node {node.name}: {node.format_node()}"
                               if node is not None else "")
                            + (f"\n  from {where}" if where else "") + hint) from exc

    def failing_node(self, exc: BaseException) -> fx.Node | None:
        """The node whose generated line raised `exc`, when the traceback shows it."""
        line, tb = None, exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code is self._code:
                line = tb.tb_lineno
            tb = tb.tb_next
        # fx records, per generated line (counted from the prologue), the node it runs.
        lines = getattr(self.gm, "_lineno_map", None)
        if line is None or not lines:
            return None
        index = lines.get(line - getattr(self.gm, "_prologue_start", 0))
        return self._nodes[index] if index is not None else None


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one optimizer step did."""

    step: int
    """1-based step number."""
    loss: float
    """Mean loss over the global batch."""
    lr: float
    """Learning rate of the update."""
    grad_norm: float
    """Global gradient norm before clipping."""
    step_time: float
    """Wall-clock seconds of the step on this rank."""
    tokens: int
    """Tokens in the global batch."""
    nonfinite: tuple[int, ...] = ()
    """Ranks that saw a NaN or Inf in the loss or a gradient; then no rank updated."""
    comm_wait: float = 0.0
    """Seconds this rank spent blocked waiting for collectives during the step: the
    communication that computation did not hide (exposed)."""
    rank_work: tuple[float, ...] = ()
    """Seconds each rank (by global rank) worked in the step rather than waited for
    collectives (its step_time - comm_wait): where a slow rank shows; empty when not
    gathered."""
    expert_tokens: tuple[float, ...] = ()
    """Under expert parallelism, (min, mean, max) rows one expert received in one layer's
    dispatch of one micro-batch (its ep group's tokens): how even the router was; empty
    without."""
    expert_dropped: int | None = None
    """With `moe.capacity_factor`, the routed rows this rank dropped over the experts'
    capacity in the step's forwards; None without a capacity."""
    expert_imbalance: float | None = None
    """Under expert parallelism, the rows the busiest ep rank received in a layer's
    dispatch over the mean, averaged over the step's dispatches (rank 0's ep group): what
    `moe.imbalance` prices; None without."""

    @property
    def tokens_per_s(self) -> float:
        """Global-batch tokens per second."""
        return self.tokens / self.step_time if self.step_time > 0 else 0.0


@dataclass(eq=False)
class Chunk:
    """One stage graph this rank holds, with its weights and gradient machinery."""

    info: StageInfo
    gm: fx.GraphModule
    runner: GraphRunner
    units: list[UnitState]
    reducer: GradReducer | None
    last_backward: int
    """Micro-batch of the stage's last B (or W) in the step: its gradients are complete
    after it."""
    overlap: OverlapPlan
    """The comm_overlap pass's buckets and prefetch depth for this stage."""
    trainable: list[torch.Tensor]
    """The stage graph's weights that get gradients (a split backward's W computes them)."""


@dataclass(eq=False)
class _Live:
    """One stage micro-batch between its F and its B."""

    inputs: list[torch.Tensor]
    outputs: object
    session: ParamSession | None = None
    grads: list[torch.Tensor] = field(default_factory=list)


@dataclass(eq=False)
class _PendingWeights:
    """A stage micro-batch between its I and its W: what W runs, and under ZeRO-3 the
    micro-batch's parameter session (its re-gathered weights, its reduce-scatters)."""

    weights: WeightBackward
    session: ParamSession | None


@dataclass(eq=False)
class _StepState:
    """What the actions of one step share: transfers, live micro-batches, the loss."""

    step: int
    skipped: int
    """Samples a rollback skipped before this step."""
    scale: float
    """1 / (m · dp): the loss scale that makes gradient sums the global-batch mean."""
    loss_sum: torch.Tensor
    recvs: dict[Action, Transfer] = field(default_factory=dict)
    live: dict[tuple[int, int], _Live] = field(default_factory=dict)
    sends: list[Transfer] = field(default_factory=list)
    batches: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    weights: dict[tuple[int, int], _PendingWeights] = field(default_factory=dict)
    """The Ws to come of the stage micro-batches whose I ran."""
    in_flight: int = 0
    routed: RoutedTokens = field(default_factory=RoutedTokens)
    """The rows the forwards' expert dispatches routed to each expert (`StepStats`)."""


@dataclass(eq=False)
class _Tied:
    """This rank's copies of a tied weight (a unit of their own each), the group of its holders."""

    name: str
    units: list[UnitState]
    group: dist.ProcessGroup
    uncounted: list[UnitState]
    """Copies left out of the gradient norm: all but the first holding stage's."""

    def sum_grads(self) -> None:
        """Make every copy's gradient the sum over all copies, on every holding rank."""
        total = self.units[0].grad
        for unit in self.units[1:]:
            total.add_(unit.grad)
        all_reduce_flat(total, self.group).wait()
        for unit in self.units[1:]:
            unit.grad.copy_(total)


class Trainer:
    """One rank's training state for a Program: its stage graphs, weights, optimizer, data."""

    def __init__(self, program: Program, groups: Mapping[str, dist.ProcessGroup | None], *,
                 models: ModelFactory, device: torch.device | str = "cpu",
                 model: nn.Module | None = None,
                 values: Mapping[str, torch.Tensor] | None = None):
        """Build this rank's chunks: weights bound into copies of its stage graphs, optimizer, data.

        `groups` maps axis names to this rank's process groups (empty: one
        process). `models` builds the plan's model and gives its initial
        values (handed in from above: `ptc.models`). `model` is the model
        whose names, init rules and buffers the weights follow (default: the
        program's own module, else the plan's model `models` builds); `values`
        replaces the plan's initial weights (full tensors by canonical name).
        """
        plan = self.plan = program.plan
        self.program, self.groups = program, dict(groups)
        self.device = torch.device(device)
        self.group, self.pp_group = self.groups.get("dp"), self.groups.get("pp")
        self.tp_group = self.groups.get("tp")
        self.dp, self.dp_rank = group_size(self.group), group_rank(self.group)
        batch = self.groups.get("batch", self.group)  # the dp axis alone (cp > 1: not dp·cp)
        self.batch_ranks, self.batch_rank = group_size(batch), group_rank(batch)
        self.pp, self.pp_rank = group_size(self.pp_group), group_rank(self.pp_group)
        self.tp_rank = group_rank(self.tp_group)
        self.ep_group, self.edp_group = self.groups.get("ep"), self.groups.get("edp")
        """Expert parallelism: the ranks that share out the experts, and those that hold the
        same ones (`ptc.runtime.mesh.expert_groups`); None when ep = 1."""
        self.ep_rank = group_rank(self.ep_group)
        for axis, size in (("tp", group_size(self.tp_group)), ("pp", self.pp),
                           ("ep", group_size(self.ep_group))):
            if size != plan.parallel.degree(axis):
                raise PtcError(f"the program is split over {axis} = {plan.parallel.degree(axis)},"
                               f" but this rank's {axis} group has {size} rank(s)")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.action: Action | None = None
        """The action of the step running now, if any (what a stall report names)."""
        self.zero = plan.parallel.zero
        self.guard = FoldedGuard(self.rank, self.dp, self.device) if self._guard_folds() else None
        """The non-finite guard when the gradient all-reduce carries it (else None)."""
        seed_dropout(plan, self.tp_group, self.rank)
        schedule = self.schedule = program.schedule
        self.actions = program.actions[self.pp_rank]
        self.splits_backward = any(a.kind == "I" for a in self.actions)
        """Whether this rank runs backwards as I then W (`ptc.runtime.split_backward`)."""
        if model is None:
            model = program.model if program.model is not None else \
                reference_model(plan, models.build)
        values = rank_values(program, model, models.initial_value, values, self.tp_rank,
                             self.ep_rank)
        tp = program.tensor_parallel
        self.canonical = {alias: slot.name for slot in program.layout.params.values()
                          for alias in slot.aliases}
        self.frozen_names = program.frozen
        """Names of the parameters the model does not train (requires_grad = False)."""
        self.chunks: dict[int, Chunk] = {
            s: self._chunk(program, s, values, model) for s in schedule.stages_of(self.pp_rank)}
        self.units = [u for chunk in self.chunks.values() for u in chunk.units]
        """Every unit this rank holds, chunk by chunk."""
        self.offload: HostOptimizer | None = offload_masters(self.units, self.device) \
            if plan.parallel.offload == "optimizer" else None
        """With optimizer offload: the update on the host and its copies (`ptc.runtime.offload`)."""
        self.optimizer = ShardedOptimizer(
            self.units, plan.train.optimizer, self.group, sharded=self.zero >= 1,
            tp_group=self.tp_group, ep_group=self.ep_group,
            replicated=None if tp is None else replicated_ranges(self.units, tp, zero=self.zero),
            frozen=slot_ranges(self.units, self._frozen, whole=self.zero == 0))
        self.frozen_grads = slot_ranges(self.units, self._frozen, whole=False) \
            if self.zero == 3 else []
        """Per unit, the ranges of its gradient shard that hold parameters the model does
        not train, which ZeRO-3's graph computes gradients for (it reads flat shards);
        empty below ZeRO-3, where autograd computes none (`build_units`)."""
        self.partial = [] if tp is None else partial_grad_ranges(self.units, tp, zero=self.zero)
        self.tied = self._tied_groups()
        self.data = TokenSource(plan.train.data, vocab=program.vocab, seq_len=plan.train.seq_len)
        self.peak_in_flight = 0
        """Most stage micro-batches held between their F and B at once, over all steps."""
        self._handlers: dict[str, Callable[[Action, _StepState], None]] = {
            "RECV_F": self._recv_forward, "RECV_B": self._recv_backward, "F": self._forward,
            "SEND_F": self._send_forward, "B": self._backward, "SEND_B": self._send_backward,
            "I": self._input_backward, "W": self._weight_backward}

    def _chunk(self, program: Program, s: int, values: Mapping[str, torch.Tensor],
               model: nn.Module) -> Chunk:
        stage = program.stages[s]
        layout = stage.layout
        gm = copy.deepcopy(stage.graph)
        bind_device(gm, self.device)  # tensors the graph creates: on this rank's device
        mine = {slot.name: values[self.canonical[slot.name]] for slot in layout.params.values()}
        grad_dtype = COMPUTE_DTYPES[self.plan.train.grad_dtype]
        units = build_units(gm, layout, mine, zero=self.zero,
                            dtype=COMPUTE_DTYPES[self.plan.train.compute_dtype], place=self._place,
                            device=self.device, grad_dtype=grad_dtype, frozen=self._frozen)
        bind_buffers(gm, initial_buffers(gm, self.plan, model), self.device)
        overlap = stage.overlap
        reducer = GradReducer(units, self.zero, overlap, grad_dtype,
                              self.plan.parallel.grad_comm, self.guard) if self.zero < 3 else None
        last = [a.microbatch for a in self.actions if a.kind in ("B", "W") and a.stage == s][-1]
        runner = GraphRunner(gm, self.rank, compiled=self.plan.runtime.compile)
        return Chunk(info=stage.info, gm=gm, runner=runner, units=units,
                     reducer=reducer, last_backward=last, overlap=overlap,
                     trainable=[w for w in gm.parameters() if w.requires_grad])

    def _place(self, unit: ShardUnit) -> Placement:
        """The group a unit is sharded and reduced over, this rank's place in it, its size:
        dp·cp, or for an expert unit the ranks that hold the same experts."""
        group = self.edp_group if unit.expert else self.group
        return group, group_rank(group), group_size(group)

    def _frozen(self, slot: ParamSlot) -> bool:
        """Whether `slot` holds a parameter the model does not train."""
        return not self.frozen_names.isdisjoint(slot.aliases)

    def _guard_folds(self) -> bool:
        """Whether the non-finite guard rides the gradient all-reduce (`FoldedGuard`), as the
        compile decided (`Decisions.guard_folds`, priced so). It reads the gradients before
        their reduction: at ZeRO-0 a frozen parameter's stay zero there, as autograd computes
        none (`build_units`)."""
        return dist.is_initialized() and self.program.decisions.guard_folds

    def _tied_groups(self) -> list[_Tied]:
        """A process group per tied weight and coordinate of the other axes (made by every rank)."""
        holders: dict[str, list[int]] = {}
        for stage in self.program.stages:
            for _, canonical in stage.info.tied:
                holders.setdefault(canonical, []).append(stage.info.index)
        if not holders:
            return []
        par = self.plan.parallel
        names = tuple(reversed(par.order))  # outermost first, as build_mesh lays ranks out
        grid = torch.arange(dist.get_world_size()).reshape([par.degree(a) for a in names])
        grid = grid.movedim(names.index("pp"), -1).reshape(-1, self.pp)
        tied = []
        for canonical in sorted(holders):
            stages = holders[canonical]
            pp_ranks = sorted({self.schedule.rank_of(s) for s in stages})
            for row in grid:  # every rank creates every group, in the same order
                ranks = [int(row[r]) for r in pp_ranks]
                group = dist.new_group(ranks, timeout=timeout())
                if self.rank not in ranks:
                    continue
                copies = {s: next(u for u in chunk.units if u.spec.params == (name,))
                          for s, chunk in self.chunks.items()
                          for name, c in chunk.info.tied if c == canonical}
                tied.append(_Tied(name=canonical, units=list(copies.values()), group=group,
                                  uncounted=[u for s, u in copies.items() if s != min(stages)]))
        return tied

    # ------------------------------------------------------------------ step

    def train_step(self, step: int, *, position: int | None = None,
                   leave_weights: bool = False) -> StepStats:
        """Run optimizer step `step` (0-based) on this rank; collective over every axis.

        `position` is the index of the step's first sample (default: step ·
        global_batch; larger once a rollback skipped data). When any rank
        sees a non-finite loss or gradient — all ranks learn it through one
        all-reduce, or through the gradient all-reduce (`FoldedGuard`) — no
        rank updates, and the stats name those ranks. `leave_weights`: at
        ZeRO 1-2 with overlap, leave the updated weights' all-gathers in flight
        for the next step's forward to wait on unit by unit
        (`ptc.ops.weight_gathers`); whoever calls must `weight_gathers.settle()`
        before anything else reads the weights. Without it they are waited for here.
        """
        train = self.plan.train
        start, waited = time.perf_counter(), comm_wait_seconds()
        micro = self.plan.num_microbatches
        state = _StepState(step=step, scale=1.0 / (micro * self.dp),
                           skipped=0 if position is None else position - step * train.global_batch,
                           loss_sum=torch.zeros((), device=self.device))
        if self.guard is not None:
            self.guard.start(step, state.loss_sum, [u.grad for u in self.units])
        with bind_axes(self.groups):
            for action in self.actions:
                self.action = action
                try:
                    self._handlers[action.kind](action, state)
                except Exception as exc:
                    raise located(exc, self.rank, step, action) from exc
                state.sends = [t for t in state.sends if not t.done()]
            self.action = None
            weight_gathers.settle()  # units the forward did not read: before the update
            for transfer in state.sends:
                transfer.wait()
            for chunk in self.chunks.values():
                if chunk.reducer is not None:
                    chunk.reducer.finish()
            for tied in self.tied:
                tied.sum_grads()
            sum_partial_grads(self.units, self.partial, self.tp_group)
            drop_grads(self.units, self.frozen_grads)
            fill_main_grads(self.units)
            lr = learning_rate(step, train.optimizer.lr, train.lr_schedule, train.steps)

            def norm_share() -> torch.Tensor:
                # With offload, of the gradients where the reductions left them (the device).
                return self.optimizer.norm_share(
                    uncounted=self._uncounted, whole=self.guard is not None,
                    grads=self.offload.sources if self.offload is not None else None)

            def update(squared_norm: torch.Tensor) -> float:
                faults.at_phase("optimizer", self.rank, step + 1)
                if self.offload is not None:  # clips, steps and publishes unit by unit
                    return self.offload.update(self.optimizer, lr, train.grad_clip, squared_norm)
                norm = self.optimizer.clip(train.grad_clip, squared_norm)
                self.optimizer.step(lr)
                leave = leave_weights and self.plan.parallel.overlap
                for s, chunk in self.chunks.items():
                    publish(chunk.units, zero=self.zero,
                            leave=functools.partial(weight_gathers.expect, s) if leave else None)
                return norm

            # One flag per rank of the job (every axis): all ranks skip or update together.
            # The tp ranks of a stage compute the same loss: one of them reports it.
            share = state.loss_sum if self.tp_rank == 0 else torch.zeros_like(state.loss_sum)
            bad, norm, loss_sum = guarded_update(self.rank, step, state.loss_sum, share,
                                                 [u.grad for u in self.units], norm_share,
                                                 update, self.guard)
            self.optimizer.zero_grad()
            if train.dtype == "fp8":  # the step's amaxes join the delayed-scaling history
                for chunk in self.chunks.values():
                    advance_amax_history(chunk.gm)
        return StepStats(step=step + 1, loss=float(loss_sum) / (micro * self.dp), lr=lr,
                         grad_norm=norm, step_time=time.perf_counter() - start,
                         tokens=train.global_batch * train.seq_len, nonfinite=bad,
                         comm_wait=comm_wait_seconds() - waited,
                         expert_tokens=state.routed.spread(),
                         expert_dropped=state.routed.dropped,
                         expert_imbalance=state.routed.imbalance())

    @property
    def _uncounted(self) -> set[int]:
        """ids of the units the gradient norm leaves out (copies of tied weights)."""
        return {id(u) for t in self.tied for u in t.uncounted}

    def _recv_forward(self, action: Action, state: _StepState) -> None:
        chunk = self.chunks[action.stage]
        state.recvs[action] = post_recv(chunk.info.inputs,
                                        self.schedule.rank_of(action.stage - 1),
                                        self.pp_group, self.device)

    def _recv_backward(self, action: Action, state: _StepState) -> None:
        chunk = self.chunks[action.stage]
        state.recvs[action] = post_recv(chunk.info.outputs,
                                        self.schedule.rank_of(action.stage + 1),
                                        self.pp_group, self.device, grads=True)

    def _send_forward(self, action: Action, state: _StepState) -> None:
        live = state.live[action.stage, action.microbatch]
        state.sends.append(send(live.outputs, self.schedule.rank_of(action.stage + 1),
                                self.pp_group))

    def _send_backward(self, action: Action, state: _StepState) -> None:
        live = state.live.pop((action.stage, action.microbatch))
        state.sends.append(send(live.grads, self.schedule.rank_of(action.stage - 1),
                                self.pp_group))

    def _batch(self, mb: int, state: _StepState) -> dict[str, torch.Tensor]:
        """The micro-batch's tokens and targets (read once per step, by every stage needing them)."""
        if mb not in state.batches:
            tokens, targets = self.data.batch(self._first_sample(mb, state),
                                              self.plan.train.micro_batch)
            state.batches[mb] = {"tokens": to_device(tokens, self.device),
                                 "targets": to_device(targets, self.device)}
        return state.batches[mb]

    def _first_sample(self, mb: int, state: _StepState) -> int:
        """Global index of micro-batch `mb`'s first sample on this rank."""
        train = self.plan.train
        return state.skipped + microbatch_start(state.step, mb, dp_rank=self.batch_rank,
                                                dp=self.batch_ranks,
                                                global_batch=train.global_batch,
                                                micro_batch=train.micro_batch)

    def _forward(self, action: Action, state: _StepState) -> None:
        faults.at_phase("forward", self.rank, state.step + 1)
        s, mb = action.stage, action.microbatch
        chunk = self.chunks[s]
        info = chunk.info
        transfer = state.recvs.pop(Action(s, "RECV_F", mb), None)
        inputs = transfer.wait() if transfer is not None else []
        for tensor, spec in zip(inputs, info.inputs):
            tensor.requires_grad_(spec.requires_grad)
        data = self._batch(mb, state) if info.data else {}
        args = [*inputs, *(data[name] for name in info.data)]
        # Sequence parallelism keeps only local chunks of gathered activations for backward.
        regather = SeqRegather() if self.plan.parallel.sequence_parallel and self.tp_group \
            else None
        session = None
        if self.zero == 3:  # with offload, a shard's first gather waits for its new weights
            session = ParamSession(prefetch=chunk.overlap.prefetch > 0,
                                   in_flight=chunk.overlap.in_flight,
                                   arrivals=self.offload.arrivals if self.offload else None)
        # Dropout masks follow the samples, whatever the layout (ptc.ops.dropout).
        samples = Samples(seed=self.plan.runtime.seed, first=self._first_sample(mb, state))
        # A backward split into I and W reads a checkpointed region twice: rebuilt once.
        once = recompute_once() if self.splits_backward else contextlib.nullcontext()
        with session or contextlib.nullcontext(), forward_context(
                regather, session.saved_tensor_hooks() if session is not None else None), \
                dropout_samples(samples), once, state.routed:
            outputs = chunk.runner.run(*args)
        for tensor, spec in zip(outputs if not info.is_last else (), info.outputs):
            if tuple(tensor.shape) != spec.shape:
                raise RankError(f"rank {self.rank}: stage {info.index} made boundary value "
                                f"{spec.name} of shape {tuple(tensor.shape)}; the compiled split "
                                f"expects {spec.shape}")
        state.live[s, mb] = _Live(inputs=inputs, outputs=outputs, session=session)
        if info.is_last:
            state.loss_sum += outputs.detach().float()
        elif self.schedule.rank_of(s + 1) == self.pp_rank:  # the next stage is this rank's
            # As a receive would: a buffer of its own, cut from this stage's autograd graph.
            state.recvs[Action(s + 1, "RECV_F", mb)] = Transfer(
                [], [t.detach().clone() for t in outputs])
        state.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, state.in_flight)

    def _backward(self, action: Action, state: _StepState) -> None:
        faults.at_phase("backward", self.rank, state.step + 1)
        s, mb = action.stage, action.microbatch
        chunk, live = self.chunks[s], state.live[s, mb]
        info = chunk.info
        transfer = state.recvs.pop(Action(s, "RECV_B", mb), None)
        if chunk.reducer is not None:
            chunk.reducer.begin(last_micro=mb == chunk.last_backward)
        with self._backward_of(info, mb, state):
            with live.session if live.session is not None else contextlib.nullcontext():
                outputs, grads = self._backward_seeds(live, info, transfer, state)
                if outputs:
                    torch.autograd.backward(outputs, grads)
                if live.session is not None:
                    live.session.finish()
        live.grads = [t.grad if t.grad is not None else torch.zeros_like(t)
                      for t, spec in zip(live.inputs, info.inputs) if spec.requires_grad]
        live.inputs, live.outputs, live.session = [], None, None
        state.in_flight -= 1
        self._input_gradients_made(info, mb, state)

    def _input_backward(self, action: Action, state: _StepState) -> None:
        """I: the gradients of the stage's inputs, which the previous stage waits for; its
        weights' come in the micro-batch's W (`ptc.runtime.split_backward`)."""
        faults.at_phase("backward", self.rank, state.step + 1)
        s, mb = action.stage, action.microbatch
        chunk, live = self.chunks[s], state.live[s, mb]
        info = chunk.info
        transfer = state.recvs.pop(Action(s, "RECV_B", mb), None)
        wanted = [t for t, spec in zip(live.inputs, info.inputs) if spec.requires_grad]
        # ZeRO-3: the weights I re-gathers stay gathered for W, whose gradients'
        # reduce-scatters run in W (`ptc.ops.zero3`).
        with self._backward_of(info, mb, state), live.session or contextlib.nullcontext():
            outputs, grads = self._backward_seeds(live, info, transfer, state)
            got, weights = input_backward(outputs, grads, wanted, chunk.trainable)
        live.grads = [g if g is not None else torch.zeros_like(t) for t, g in zip(wanted, got)]
        state.weights[s, mb] = _PendingWeights(weights, live.session)
        live.inputs, live.outputs, live.session = [], None, None
        self._input_gradients_made(info, mb, state)

    def _weight_backward(self, action: Action, state: _StepState) -> None:
        """W: the gradients of the stage's weights, from what its I kept."""
        faults.at_phase("backward", self.rank, state.step + 1)
        s, mb = action.stage, action.microbatch
        chunk = self.chunks[s]
        if chunk.reducer is not None:
            chunk.reducer.begin(last_micro=mb == chunk.last_backward)
        pending = state.weights.pop((s, mb))
        with self._backward_of(chunk.info, mb, state), \
                pending.session or contextlib.nullcontext():
            pending.weights.run()
            if pending.session is not None:
                pending.session.finish()
        state.in_flight -= 1

    def _input_gradients_made(self, info: StageInfo, mb: int, state: _StepState) -> None:
        """After a B or an I: the micro-batch is done on the first stage; where the previous
        stage is this rank's too, its gradients go to it here (else a SEND_B sends them)."""
        s = info.index
        if info.is_first:
            del state.live[s, mb]
        elif self.schedule.rank_of(s - 1) == self.pp_rank:
            state.recvs[Action(s - 1, "RECV_B", mb)] = Transfer([], state.live.pop((s, mb)).grads)

    @staticmethod
    def _backward_seeds(live: _Live, info: StageInfo, transfer,
                        state: _StepState) -> tuple[list[torch.Tensor], list | None]:
        """(outputs, their gradients) a backward of `live` starts from: the loss scaled by
        1 / (m·dp) on the last stage (gradients None: ones), else the outputs the next stage
        sent gradients for. Empty where nothing before them trains."""
        if info.is_last:
            return ([live.outputs * state.scale], None) if live.outputs.requires_grad \
                else ([], None)
        outs = [t for t, spec in zip(live.outputs, info.outputs) if spec.requires_grad]
        # An output made from frozen parameters alone has nothing to send back to.
        pairs = [(t, g) for t, g in zip(outs, transfer.wait()) if t.requires_grad]
        return [t for t, _ in pairs], [g for _, g in pairs]

    @contextlib.contextmanager
    def _backward_of(self, info: StageInfo, mb: int, state: _StepState):
        """A failure inside as a RankError naming the stage, micro-batch and step."""
        try:
            yield
        except Exception as exc:
            where = f"stage {info.index}, " if info.num_stages > 1 else ""
            raise RankError(f"rank {self.rank}: {type(exc).__name__}: {exc}\n  during backward "
                            f"of {where}micro-batch {mb}, step {state.step + 1}") from exc

    def settle_copies(self) -> None:
        """Wait for the weights still on their way to the device (optimizer offload): call
        before the masters or the graph's weights are written outside a step (a restore)."""
        if self.offload is not None:
            self.offload.settle()

    # --------------------------------------------------------------- reports

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full fp32 master weights by every name the model knows them by, on every rank
        (collective): a tied weight under each of its names, as `model.state_dict()` has it."""
        mine: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for unit in self.units:
                full = unit.master if self.zero == 0 else all_gather_flat(
                    unit.master.detach().to(self.device).contiguous(), unit.group).wait()
                for slot in unit.slots:
                    mine.setdefault(self.canonical[slot.name], full[
                        slot.offset:slot.offset + slot.numel].view(slot.shape).clone().cpu())
        if self.program.decisions.expert_parallel is not None:
            mine = join_over_tp(mine, self.program.decisions.expert_parallel, self.ep_group)
        if self.program.tensor_parallel is not None:
            mine = join_over_tp(mine, self.program.tensor_parallel, self.tp_group)
        if self.pp > 1:
            parts: list[dict[str, torch.Tensor]] = [{} for _ in range(self.pp)]
            dist.all_gather_object(parts, mine, group=self.pp_group)
            mine = {}
            for part in parts:
                for name, value in part.items():
                    mine.setdefault(name, value)
        return {alias: mine[slot.name] for slot in self.program.layout.params.values()
                if slot.name in mine for alias in slot.aliases}

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds now, on the
        device, and in host memory for optimizer offload ("host")."""
        total = dict.fromkeys(("params", "grads", "optimizer", "host"), 0)
        state = self.optimizer.state_tensors()
        for index, chunk in enumerate(self.chunks.values()):
            mine = state if index == 0 else []
            host = [] if self.offload is None else [*mine, *self.offload.host_tensors(chunk.units)]
            held = held_bytes(chunk.gm, chunk.units, mine, host)
            for key, value in held.items():
                total[key] += value
        return total
