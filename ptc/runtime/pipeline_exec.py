"""One pipeline rank's training step: its stage graphs run under the Program's schedule.

Terms: p pipeline ranks, v chunks per rank, m micro-batches per step. The
rank holds the stage graphs s = chunk·p + rank (`ptc.compiler.stages`
says what each takes and gives). Its part of the schedule, lowered with
sends and receives (`ptc.compiler.schedule.lower`), runs action by action:

- RECV_F / RECV_B post the receives of a stage's input activations / of
  the gradients of its outputs (asynchronous: the transfer overlaps the
  compute actions before the one that waits for it);
- F runs the stage graph on the received activations — made autograd
  leaves — and the micro-batch's tokens / targets, which every rank reads
  itself; the inputs and outputs stay alive until the micro-batch's B;
- SEND_F sends the outputs, SEND_B the gradients of the inputs
  (asynchronous; a sent tensor is dropped as soon as its send completes);
- B runs backward from the received gradients (the last stage: from
  loss / (m·dp)) and drops the micro-batch's activations at once.

Gradients per chunk as in the one-stage executor: `GradReducer` at ZeRO
0-2 (its "last micro-batch" is the chunk's last B of the step), and at
ZeRO-3 a `ParamSession` per chunk and micro-batch, so each stage gathers
its own layers' weights, per micro-batch, only where its graph uses them.
After the last action: the gradients of tied weights (an embedding shared
with the LM head) are summed between the stages holding them, over a
process group of those ranks; the global gradient norm sums every rank's
shards over dp, tp and pp, counting a tied weight once; then, unless a rank
saw a NaN or Inf, the update and the publishing of the new weights, as at
one stage. Under tensor parallelism the stage graphs hold tp-local weights
(`ptc.runtime.tp_state`) and run their own tp collectives; a tied weight's
group pairs the stages' ranks of the same tp and dp coordinates.

The rank counts its in-flight stage micro-batches (forwarded, not yet
backwarded) and keeps the peak in `peak_in_flight`: the number the memory
model's `in_flight` charges activations for.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import fx, nn

from ptc.compiler.program import COMPUTE_DTYPES, Program
from ptc.compiler.schedule import Action, lower
from ptc.compiler.stages import StageInfo, stage_info
from ptc.ops.comm import all_gather_flat, all_reduce_flat, bind_axes, comm_wait_seconds, \
    group_rank, group_size
from ptc.runtime.data import TokenSource, microbatch_start
from ptc.runtime.executor import GraphRunner, RankError, StepStats
from ptc.compiler.overlap import OverlapPlan, stage_overlap
from ptc.runtime.grads import GradReducer
from ptc.runtime.health import guarded_update
from ptc.runtime.init import initial_buffers, reference_model
from ptc.runtime.lr import learning_rate
from ptc.runtime.mesh import timeout
from ptc.runtime.optimizer import CLIP_EPS, ShardedOptimizer
from ptc.runtime.p2p import Transfer, post_recv, send
from ptc.runtime.params import UnitState, bind_buffers, build_units, held_bytes, publish
from ptc.runtime.tp_state import (join_over_tp, rank_values, replicated_ranges, seed_dropout,
                                   sequence_partial_ranges, sum_sequence_partial_grads)
from ptc.ops.zero3 import ParamSession


@dataclass(eq=False)
class _Chunk:
    """One stage graph this rank holds, with its weights and gradient machinery."""

    info: StageInfo
    gm: fx.GraphModule
    runner: GraphRunner
    units: list[UnitState]
    reducer: GradReducer | None
    last_backward: int
    """Micro-batch of the chunk's last B in the step: its gradients are complete after it."""
    overlap: OverlapPlan
    """The comm_overlap pass's buckets and prefetch depth for this stage."""


@dataclass(eq=False)
class _Live:
    """One stage micro-batch between its F and its B."""

    inputs: list[torch.Tensor]
    outputs: object
    session: ParamSession | None = None
    grads: list[torch.Tensor] = field(default_factory=list)


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


class PipelineTrainer:
    """One pipeline rank's training state: its stage graphs, weights, optimizer, schedule."""

    def __init__(self, program: Program, groups: Mapping[str, dist.ProcessGroup | None], *,
                 device: torch.device | str = "cpu", model: nn.Module | None = None,
                 values: Mapping[str, torch.Tensor] | None = None):
        """Build this rank's chunks from the Program (arguments as `executor.Trainer`'s)."""
        plan = self.plan = program.plan
        self.program, self.groups = program, dict(groups)
        self.device = torch.device(device)
        self.group, self.pp_group = self.groups.get("dp"), self.groups["pp"]
        self.tp_group = self.groups.get("tp")
        self.dp, self.dp_rank = group_size(self.group), group_rank(self.group)
        self.pp, self.pp_rank = group_size(self.pp_group), group_rank(self.pp_group)
        self.tp_rank = group_rank(self.tp_group)
        self.rank = dist.get_rank()
        self.zero = plan.parallel.zero
        seed_dropout(plan, self.tp_group, self.rank)
        schedule = program.schedule
        self.actions = lower(schedule)[self.pp_rank]
        model = model if model is not None else reference_model(plan)
        values = rank_values(program, model, values, self.tp_rank)
        tp = program.tensor_parallel
        self.canonical = {alias: slot.name for slot in program.layout.params.values()
                          for alias in slot.aliases}
        self.chunks: dict[int, _Chunk] = {}
        for s in schedule.stages_of(self.pp_rank):
            self.chunks[s] = self._chunk(program, s, values, model)
        units = [u for chunk in self.chunks.values() for u in chunk.units]
        self.optimizer = ShardedOptimizer(
            units, plan.train.optimizer, self.group, sharded=self.zero >= 1,
            tp_group=self.tp_group, replicated=None if tp is None else replicated_ranges(
                units, tp, zero=self.zero, rank=self.dp_rank))
        self.partial = [] if tp is None else sequence_partial_ranges(
            units, tp, zero=self.zero, rank=self.dp_rank)
        self.tied = self._tied_groups()
        self.data = TokenSource(plan.train.data, vocab=plan.model.vocab, seq_len=plan.train.seq_len)
        self.peak_in_flight = 0
        """Most stage micro-batches held between their F and B at once, over all steps."""

    def _chunk(self, program: Program, s: int, values: Mapping[str, torch.Tensor],
               model: nn.Module) -> _Chunk:
        stage = program.stages[s]
        gm = copy.deepcopy(stage.graph)
        mine = {slot.name: values[self.canonical[slot.name]]
                for slot in stage.layout.params.values()}
        units = build_units(gm, stage.layout, mine, zero=self.zero,
                            dtype=COMPUTE_DTYPES[self.plan.train.dtype], rank=self.dp_rank,
                            world=self.dp, device=self.device)
        bind_buffers(gm, initial_buffers(gm, self.plan, model), self.device)
        overlap = stage_overlap(stage, stage.layout, self.plan)
        reducer = GradReducer(units, self.group, self.zero, overlap) if self.zero < 3 else None
        last = [a.microbatch for a in self.actions if a.kind == "B" and a.stage == s][-1]
        return _Chunk(info=stage_info(gm), gm=gm, runner=GraphRunner(gm, self.rank), units=units,
                      reducer=reducer, last_backward=last, overlap=overlap)

    def _tied_groups(self) -> list[_Tied]:
        """A process group per tied weight and coordinate of the other axes (made by every rank)."""
        holders: dict[str, list[int]] = {}
        for stage in self.program.stages:
            for _, canonical in stage_info(stage.graph).tied:
                holders.setdefault(canonical, []).append(stage_info(stage.graph).index)
        par = self.plan.parallel
        names = tuple(reversed(par.order))  # outermost first, as build_mesh lays ranks out
        grid = torch.arange(dist.get_world_size()).reshape([par.degree(a) for a in names])
        grid = grid.movedim(names.index("pp"), -1).reshape(-1, self.pp)
        tied = []
        for canonical in sorted(holders):
            stages = holders[canonical]
            pp_ranks = sorted({s % self.pp for s in stages})
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

    def train_step(self, step: int, *, position: int | None = None) -> StepStats:
        """Run optimizer step `step` (0-based) on this rank; collective over every axis.

        `position` and the non-finite rule are those of `executor.Trainer.train_step`.
        """
        train = self.plan.train
        skipped = 0 if position is None else position - step * train.global_batch
        start, waited = time.perf_counter(), comm_wait_seconds()
        micro = self.plan.num_microbatches
        loss_sum = torch.zeros((), device=self.device)
        units = [u for chunk in self.chunks.values() for u in chunk.units]
        with bind_axes(self.groups):
            loss_sum += self._run_schedule(step, skipped, 1.0 / (micro * self.dp))
            for chunk in self.chunks.values():
                if chunk.reducer is not None:
                    chunk.reducer.finish()
            for tied in self.tied:
                tied.sum_grads()
            sum_sequence_partial_grads(units, self.partial, self.tp_group)
            all_reduce_flat(loss_sum.view(1), self.group).wait()
            all_reduce_flat(loss_sum.view(1), self.pp_group).wait()
            lr = learning_rate(step, train.optimizer.lr, train.lr_schedule, train.steps)

            def update() -> float:
                norm = self._clip(train.grad_clip)
                self.optimizer.step(lr)
                for chunk in self.chunks.values():
                    publish(chunk.units, self.group, zero=self.zero, rank=self.dp_rank,
                            world=self.dp)
                return norm

            # One flag per rank of the job (every axis): all ranks skip or update together.
            bad, norm = guarded_update(self.rank, step, loss_sum, [u.grad for u in units], update)
            self.optimizer.zero_grad()
        return StepStats(step=step + 1, loss=float(loss_sum) / (micro * self.dp), lr=lr,
                         grad_norm=norm, step_time=time.perf_counter() - start,
                         tokens=train.global_batch * train.seq_len, nonfinite=bad,
                         comm_wait=comm_wait_seconds() - waited)

    def _run_schedule(self, step: int, skipped: int, scale: float) -> torch.Tensor:
        """Run this rank's lowered schedule once; return the sum of its micro-batch losses."""
        p = self.pp
        recvs: dict[Action, Transfer] = {}
        live: dict[tuple[int, int], _Live] = {}
        sends: list[Transfer] = []
        batches: dict[int, dict[str, torch.Tensor]] = {}
        loss_sum = torch.zeros((), device=self.device)
        in_flight = 0
        for action in self.actions:
            s, mb, kind = action.stage, action.microbatch, action.kind
            chunk = self.chunks[s]
            if kind == "RECV_F":
                recvs[action] = post_recv(chunk.info.inputs, (s - 1) % p, self.pp_group,
                                          self.device)
            elif kind == "RECV_B":
                recvs[action] = post_recv(chunk.info.outputs, (s + 1) % p, self.pp_group,
                                          self.device, grads=True)
            elif kind == "F":
                transfer = recvs.pop(Action(s, "RECV_F", mb), None)
                live[s, mb] = self._forward(chunk, step, mb, transfer, batches, skipped)
                if chunk.info.is_last:
                    loss_sum += live[s, mb].outputs.detach().float()
                in_flight += 1
                self.peak_in_flight = max(self.peak_in_flight, in_flight)
            elif kind == "SEND_F":
                sends.append(send(live[s, mb].outputs, (s + 1) % p, self.pp_group))
            elif kind == "B":
                transfer = recvs.pop(Action(s, "RECV_B", mb), None)
                self._backward(chunk, step, mb, live[s, mb], transfer, scale)
                in_flight -= 1
                if chunk.info.is_first:
                    del live[s, mb]
            elif kind == "SEND_B":
                sends.append(send(live.pop((s, mb)).grads, (s - 1) % p, self.pp_group))
            sends = [t for t in sends if not t.done()]
        for transfer in sends:
            transfer.wait()
        return loss_sum

    def _batch(self, step: int, mb: int, batches: dict[int, dict[str, torch.Tensor]],
               skipped: int) -> dict[str, torch.Tensor]:
        if mb not in batches:
            train = self.plan.train
            first = skipped + microbatch_start(step, mb, dp_rank=self.dp_rank, dp=self.dp,
                                               global_batch=train.global_batch,
                                               micro_batch=train.micro_batch)
            tokens, targets = self.data.batch(first, train.micro_batch)
            batches[mb] = {"tokens": tokens.to(self.device), "targets": targets.to(self.device)}
        return batches[mb]

    def _forward(self, chunk: _Chunk, step: int, mb: int, transfer: Transfer | None,
                 batches: dict[int, dict[str, torch.Tensor]], skipped: int) -> _Live:
        info = chunk.info
        inputs = transfer.wait() if transfer is not None else []
        for tensor, spec in zip(inputs, info.inputs):
            tensor.requires_grad_(spec.requires_grad)
        data = self._batch(step, mb, batches, skipped) if info.data else {}
        args = [*inputs, *(data[name] for name in info.data)]
        if self.zero == 3:
            session = ParamSession(prefetch=chunk.overlap.prefetch > 0,
                                   in_flight=chunk.overlap.in_flight)
            with session, session.saved_tensor_hooks():
                outputs = chunk.runner.run(*args)
        else:
            session, outputs = None, chunk.runner.run(*args)
        for tensor, spec in zip(outputs if not info.is_last else (), info.outputs):
            if tuple(tensor.shape) != spec.shape:
                raise RankError(f"rank {self.rank}: stage {info.index} made boundary value "
                                f"{spec.name} of shape {tuple(tensor.shape)}; the compiled split "
                                f"expects {spec.shape}")
        return _Live(inputs=inputs, outputs=outputs, session=session)

    def _backward(self, chunk: _Chunk, step: int, mb: int, live: _Live,
                  transfer: Transfer | None, scale: float) -> None:
        info = chunk.info
        if chunk.reducer is not None:
            chunk.reducer.begin(last_micro=mb == chunk.last_backward)
        try:
            with live.session if live.session is not None else contextlib.nullcontext():
                if info.is_last:
                    (live.outputs * scale).backward()
                else:
                    grads = transfer.wait()
                    outs = [t for t, spec in zip(live.outputs, info.outputs) if spec.requires_grad]
                    torch.autograd.backward(outs, grads)
                if live.session is not None:
                    live.session.finish()
        except Exception as exc:
            raise RankError(f"rank {self.rank}: {type(exc).__name__}: {exc}\n  during backward "
                            f"of stage {info.index}, micro-batch {mb}, step {step + 1}") from exc
        live.grads = [t.grad if t.grad is not None else torch.zeros_like(t)
                      for t, spec in zip(live.inputs, info.inputs) if spec.requires_grad]
        live.inputs, live.outputs, live.session = [], None, None

    def _clip(self, max_norm: float | None) -> float:
        """Clip by the global norm over every axis; return the norm before clipping.

        As `ShardedOptimizer.clip`, plus: a tied weight's copies count once
        (the first holder's), and the stages' sums add over pp.
        """
        skip = {id(u) for t in self.tied for u in t.uncounted}
        units = [u for chunk in self.chunks.values() for u in chunk.units]
        tp = group_size(self.tp_group)
        squares = torch.zeros((), device=self.device)
        for unit, ranges in zip(units, self.optimizer.replicated):
            if id(unit) in skip:
                continue
            grad = unit.master.grad
            squares += grad.pow(2).sum()
            # Every tp rank holds the same gradient of a replicated parameter: count it once.
            squares -= sum((grad[a:b].pow(2).sum() for a, b in ranges),
                           torch.zeros((), device=self.device)) * (1 - 1 / tp)
        if self.zero >= 1:
            all_reduce_flat(squares.view(1), self.group).wait()
        if tp > 1:
            all_reduce_flat(squares.view(1), self.tp_group).wait()
        all_reduce_flat(squares.view(1), self.pp_group).wait()
        norm = squares.sqrt()
        if max_norm is not None:
            factor = (max_norm / (norm + CLIP_EPS)).clamp(max=1.0)
            for unit in units:
                unit.master.grad.mul_(factor)
        return float(norm)

    # --------------------------------------------------------------- reports

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full fp32 master weights by canonical name, on every rank (collective)."""
        mine: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for chunk in self.chunks.values():
                for unit in chunk.units:
                    full = unit.master if self.zero == 0 else all_gather_flat(
                        unit.master.detach().contiguous(), self.group).wait()
                    for slot in unit.slots:
                        mine.setdefault(self.canonical[slot.name], full[
                            slot.offset:slot.offset + slot.numel].view(slot.shape).clone().cpu())
        if self.program.tensor_parallel is not None:
            mine = join_over_tp(mine, self.program.tensor_parallel, self.tp_group)
        parts: list[dict[str, torch.Tensor]] = [{} for _ in range(self.pp)]
        dist.all_gather_object(parts, mine, group=self.pp_group)
        out: dict[str, torch.Tensor] = {}
        for part in parts:
            for name, value in part.items():
                out.setdefault(name, value)
        return out

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds now."""
        total = dict.fromkeys(("params", "grads", "optimizer"), 0)
        state = self.optimizer.state_tensors()
        for index, chunk in enumerate(self.chunks.values()):
            held = held_bytes(chunk.gm, chunk.units, state if index == 0 else [])
            for key, value in held.items():
                total[key] += value
        return total

