"""One rank's training step on its part of a Program.

The rank runs its stage's lowered graph through `GraphRunner`, which turns
any failure into a `RankError` naming the rank, the graph node and the
user's source line. A step is: for each micro-batch,
forward and backward of loss / (micro-batches · dp) — so that gradient sums
over micro-batches and ranks are the global-batch mean — with gradient
reduction overlapped (ZeRO 0-2: `GradReducer`; ZeRO-3: the graph's
`gather_params` under a `ParamSession`); then the global-norm clip, the
optimizer update of the rank's masters, and publishing the new weights.

This trainer runs pp = 1 with any tp and dp: under tensor parallelism the graph's
parameters are the rank's tp-local slices (see `ptc.runtime.tp_state`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx, nn

from ptc.compiler.meta import get_info
from ptc.compiler.overlap import stage_overlap
from ptc.compiler.program import COMPUTE_DTYPES, Program
from ptc.errors import PtcError
from ptc.ops.comm import all_gather_flat, all_reduce_flat, bind_axes, comm_wait_seconds, \
    group_rank, group_size
from ptc.runtime.data import TokenSource, microbatch_start
from ptc.runtime.grads import GradReducer
from ptc.runtime.health import guarded_update
from ptc.runtime.init import initial_buffers, reference_model
from ptc.runtime.lr import learning_rate
from ptc.runtime.optimizer import ShardedOptimizer
from ptc.runtime.params import bind_buffers, build_units, held_bytes, publish
from ptc.ops.seq_regather import SeqRegather, forward_context
from ptc.runtime.tp_state import (join_over_tp, rank_values, replicated_ranges, seed_dropout,
                                   sequence_partial_ranges, sum_sequence_partial_grads)
from ptc.ops.zero3 import ParamSession


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


class GraphRunner:
    """Runs a lowered graph and turns any failure into a RankError naming the node.

    The graph's generated code runs directly, without fx.Interpreter's
    per-node cost (it doubles the forward time of a small model). When it
    raises, the traceback's frame in that code gives the line, and the graph
    module's line map the node: the report fx.Interpreter's "While executing"
    would give.
    """

    def __init__(self, gm: fx.GraphModule, rank: int):
        self.gm, self.rank = gm, rank
        self._code = gm.forward.__func__.__code__
        self._nodes = list(gm.graph.nodes)

    def run(self, *args: torch.Tensor):
        """The graph's output for `args`."""
        try:
            return self.gm.forward(*args)  # not gm(...): fx's wrapper drops the traceback
        except Exception as exc:
            node = self.failing_node(exc)
            where = source_line(self.gm, node) if node is not None else None
            raise RankError(f"rank {self.rank}: {type(exc).__name__}: {exc}"
                            + (f"\n  while executing node {node.name}: {node.format_node()}"
                               if node is not None else "")
                            + (f"\n  from {where}" if where else "")) from exc

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

    @property
    def tokens_per_s(self) -> float:
        """Global-batch tokens per second."""
        return self.tokens / self.step_time if self.step_time > 0 else 0.0


class Trainer:
    """One rank's training state for a Program: graph, weights, gradients, optimizer, data."""

    def __init__(self, program: Program, groups: Mapping[str, dist.ProcessGroup | None], *,
                 device: torch.device | str = "cpu", model: nn.Module | None = None,
                 values: Mapping[str, torch.Tensor] | None = None):
        """Build this rank's state: weights bound into a copy of the stage graph, optimizer, data.

        `groups` maps axis names to this rank's process groups (empty: one
        process). `model` is the model whose names, init rules and buffers
        the weights follow (default: the plan's, on meta); `values` replaces
        the plan's initial weights (full tensors by canonical name).
        """
        plan = self.plan = program.plan
        if plan.parallel.pp != 1:
            raise PtcError(f"this runtime runs pp = 1, the plan has pp = {plan.parallel.pp}")
        self.program, self.groups = program, dict(groups)
        self.device = torch.device(device)
        self.group = self.groups.get("dp")
        self.dp, self.dp_rank = group_size(self.group), group_rank(self.group)
        self.tp_group = self.groups.get("tp")
        self.tp_rank = group_rank(self.tp_group)
        if group_size(self.tp_group) != plan.parallel.tp:
            raise PtcError(f"the program is split over tp = {plan.parallel.tp}, but this rank's "
                           f"tp group has {group_size(self.tp_group)} rank(s)")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.zero = plan.parallel.zero
        seed_dropout(plan, self.tp_group, self.rank)
        self.gm = copy.deepcopy(program.stages[0].graph)
        model = model if model is not None else reference_model(plan)
        values = rank_values(program, model, values, self.tp_rank)
        tp = program.tensor_parallel
        self.units = build_units(self.gm, program.layout, values, zero=self.zero,
                                 dtype=COMPUTE_DTYPES[plan.train.dtype], rank=self.dp_rank,
                                 world=self.dp, device=self.device)
        bind_buffers(self.gm, initial_buffers(self.gm, plan, model), self.device)
        self.optimizer = ShardedOptimizer(
            self.units, plan.train.optimizer, self.group, sharded=self.zero >= 1,
            tp_group=self.tp_group, replicated=None if tp is None else replicated_ranges(
                self.units, tp, zero=self.zero, rank=self.dp_rank))
        self.partial = [] if tp is None else sequence_partial_ranges(
            self.units, tp, zero=self.zero, rank=self.dp_rank)
        self.overlap = stage_overlap(program.stages[0], program.layout, plan)
        self.reducer = GradReducer(self.units, self.group, self.zero, self.overlap) \
            if self.zero < 3 else None
        self.data = TokenSource(plan.train.data, vocab=plan.model.vocab, seq_len=plan.train.seq_len)
        self.runner = GraphRunner(self.gm, self.rank)

    def train_step(self, step: int, *, position: int | None = None) -> StepStats:
        """Run optimizer step `step` (0-based) on this rank; collective over the dp group.

        `position` is the index of the step's first sample (default: step ·
        global_batch; larger once a rollback skipped data). When any rank
        sees a non-finite loss or gradient — all ranks learn it through one
        all-reduce — no rank updates, and the stats name those ranks.
        """
        train = self.plan.train
        skipped = 0 if position is None else position - step * train.global_batch
        start, waited = time.perf_counter(), comm_wait_seconds()
        micro = self.plan.num_microbatches
        scale = 1.0 / (micro * self.dp)
        loss_sum = torch.zeros((), device=self.device)
        with bind_axes(self.groups):
            for m in range(micro):
                first = skipped + microbatch_start(step, m, dp_rank=self.dp_rank, dp=self.dp,
                                                   global_batch=train.global_batch,
                                                   micro_batch=train.micro_batch)
                tokens, targets = self.data.batch(first, train.micro_batch)
                tokens, targets = tokens.to(self.device), targets.to(self.device)
                loss_sum += self._forward_backward(tokens, targets, scale, step, m, micro)
            if self.reducer is not None:
                self.reducer.finish()
            sum_sequence_partial_grads(self.units, self.partial, self.tp_group)
            all_reduce_flat(loss_sum.view(1), self.group).wait()
            lr = learning_rate(step, train.optimizer.lr, train.lr_schedule, train.steps)

            def update() -> float:
                norm = self.optimizer.clip(train.grad_clip)
                self.optimizer.step(lr)
                publish(self.units, self.group, zero=self.zero, rank=self.dp_rank, world=self.dp)
                return norm

            bad, norm = guarded_update(self.rank, step, loss_sum, [u.grad for u in self.units],
                                       update)
            self.optimizer.zero_grad()
        return StepStats(step=step + 1, loss=float(loss_sum) / (micro * self.dp), lr=lr,
                         grad_norm=norm, step_time=time.perf_counter() - start,
                         tokens=train.global_batch * train.seq_len, nonfinite=bad,
                         comm_wait=comm_wait_seconds() - waited)

    def _forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor, scale: float,
                          step: int, micro: int, micros: int) -> torch.Tensor:
        # Sequence parallelism keeps only local chunks of gathered activations for backward.
        regather = SeqRegather() if self.plan.parallel.sequence_parallel and self.tp_group \
            else None
        if self.zero == 3:
            session = ParamSession(prefetch=self.overlap.prefetch > 0,
                                   in_flight=self.overlap.in_flight)
            with session, forward_context(regather, session.saved_tensor_hooks()):
                loss = self.runner.run(tokens, targets)
        else:
            session = contextlib.nullcontext()
            self.reducer.begin(last_micro=micro == micros - 1)
            with forward_context(regather):
                loss = self.runner.run(tokens, targets)
        try:
            with session:
                (loss * scale).backward()
                if self.zero == 3:
                    session.finish()
        except Exception as exc:
            raise RankError(f"rank {self.rank}: {type(exc).__name__}: {exc}\n"
                            f"  during backward of micro-batch {micro} of step {step + 1}") from exc
        return loss.detach().float()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full fp32 master weights by canonical name (collective over dp and tp)."""
        out = {}
        with torch.no_grad():
            for unit in self.units:
                if self.zero == 0:
                    full = unit.master
                else:
                    full = all_gather_flat(unit.master.detach().contiguous(), self.group).wait()
                for slot in unit.slots:
                    out[slot.name] = full[slot.offset:slot.offset + slot.numel].view(
                        slot.shape).clone().cpu()
        if self.program.tensor_parallel is not None:
            out = join_over_tp(out, self.program.tensor_parallel, self.tp_group)
        return out

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds now."""
        return held_bytes(self.gm, self.units, self.optimizer.state_tensors())
