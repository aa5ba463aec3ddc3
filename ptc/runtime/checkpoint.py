"""Sharded, asynchronous checkpoints of a Trainer that any layout can load, on DCP.

One checkpoint holds, saved together:

- `model.{name}`: every parameter's fp32 master under its full name and
  full shape, as `FlatChunks`. Each dp rank writes the part of the
  parameter in its 1/dp range of the unit — at ZeRO-0 too, so writing is
  spread evenly; a tp rank's slice is placed where it sits in the full
  parameter; a pipeline stage writes the parameters it holds.
- `optim.{kind}.{name}`: the optimizer's per-element state (Adam's
  exp_avg / exp_avg_sq, SGD's momentum_buffer), chunked the same way, and
  `optim.step`, Adam's update count.
- `rng.{rank}.cpu` (and `.cuda`): each rank's generator states.
- `fp8.amax_history.{r}.{linear}` with `train.dtype = fp8`: the float8
  linears' amax histories of gradient rank r (`ptc.runtime.fp8_state`:
  replicated over tp, each dp·cp rank's own).
- the manifest (`ptc.runtime.checkpoint_store`): step, data position (the
  next sample index), layout, learning-rate schedule, file checksums.

Loading asks DCP for the same keys over the ranges the *current* layout
holds, whatever layout wrote them: tp, pp, dp and the ZeRO stage may
change. RNG states come back when tp, pp and dp are the same (then resuming
is bit-identical); otherwise each tp group is reseeded from (seed, its
first rank, step). Float8 amax histories come back whatever the layout
(`ptc.runtime.fp8_state` says how they reshard).

Asynchronous saving: the rank's state is copied into host buffers allocated
once (pinned on GPUs) — the only pause training sees — then
`dcp.async_save` writes them from a background thread over a dedicated gloo
group while training goes on. When DCP is done, the same thread checksums
the files (split over ranks) and rank 0 checks DCP's index, writes the
manifest, publishes the directory, moves `latest` and applies keep-k. One
save is in flight at a time; the next save, a restore and `close` wait for
it. Non-finite weights are never written.

A save that fails (a full disk, a lost mount, on any rank) does not stop
training: the ranks agree on it when they wait for the save (`wait`), rank 0
removes its partial directory, one line says so, and the previous checkpoint
stays the latest; the next save due tries again. `saved_step` is the newest
step every rank knows was published.
"""

from __future__ import annotations

import datetime
import shutil
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from ptc.compiler.records.params import ParamSlot
from ptc.compiler.records.tp_layout import ParamShard
from ptc.runtime.checkpoint_store import (
    CheckpointError,
    CheckpointStore,
    Manifest,
    check_files,
    digest,
    step_name,
)
from ptc.runtime.dcp_chunks import FlatChunks, LoadPlanner, SavePlanner
from ptc.runtime import faults
from ptc.runtime.fp8_state import history_reads, restore_histories, saved_histories
from ptc.runtime.health import nonfinite_ranks
from ptc.runtime.params import publish

SAVE_ERRORS = (Exception, dcp.CheckpointException)
"""What a failed save raises (DCP's CheckpointException, naming the ranks whose part
failed, is no Exception): agreed on and reported, never the end of training."""

Source = Callable[[int, str], tuple[int, torch.Tensor]]
"""(unit index, kind) -> (first element in the unit's flat buffer, flat tensor from there)."""


def full_name(trainer, slot: ParamSlot) -> str:
    """The model's name of a parameter (a pipeline stage may hold it under an alias)."""
    return trainer.canonical.get(slot.name, slot.name)


def optimizer_kinds(trainer) -> tuple[str, ...]:
    """Names of the optimizer's per-element state tensors."""
    spec = trainer.plan.train.optimizer
    if spec.name == "adamw":
        return ("exp_avg", "exp_avg_sq")
    return ("momentum_buffer",) if spec.momentum > 0 else ()


def ensure_optimizer_state(trainer) -> None:
    """Create the optimizer's state where no update has yet (zeros: what the first update uses).

    torch's AdamW and SGD create their state lazily at the first update,
    from zeros (Adam) or the gradient (SGD, equal to zeros·momentum + grad),
    so a state created here gives the same numbers.
    """
    adam = trainer.plan.train.optimizer.name == "adamw"
    for unit in trainer.units:
        state = trainer.optimizer.inner.state[unit.master]
        if not state and optimizer_kinds(trainer):
            if adam:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for kind in optimizer_kinds(trainer):
                state[kind] = torch.zeros_like(unit.master, memory_format=torch.preserve_format)


def _flat(trainer, unit: int, kind: str) -> torch.Tensor:
    master = trainer.units[unit].master
    # detach: DCP reads into these views in place, and a ZeRO-3 master is a Parameter.
    return master.detach() if kind == "model" else trainer.optimizer.inner.state[master][kind]


def held(trainer) -> Source:
    """What this rank holds: the full buffers at ZeRO-0, its shard from ZeRO-1 on."""
    def source(unit: int, kind: str) -> tuple[int, torch.Tensor]:
        flat = _flat(trainer, unit, kind)
        shard = trainer.units[unit].spec.shard_numel
        start = 0 if trainer.zero == 0 else trainer.units[unit].rank * shard
        return start, flat
    return source


def owned(trainer) -> Source:
    """What this rank writes: its 1/dp range of every unit (a view of what it holds)."""
    hold = held(trainer)

    def source(unit: int, kind: str) -> tuple[int, torch.Tensor]:
        start, flat = hold(unit, kind)
        size = trainer.units[unit].spec.shard_numel
        mine = trainer.units[unit].rank * size
        return mine, flat[mine - start:mine - start + size]
    return source


def chunked_state(trainer, source: Source) -> dict[str, FlatChunks]:
    """Every parameter and optimizer tensor by full name, as the chunks `source` covers.

    Under tensor parallelism a slot holds the rank's slice of the parameter;
    its chunks are re-addressed in the full parameter (`tp_chunks`); an expert
    stack under expert parallelism first from its ep rank's experts to all of them.
    """
    tp = trainer.program.tensor_parallel
    experts = trainer.program.decisions.expert_parallel
    out = {}
    for index, unit in enumerate(trainer.units):
        for kind in ("model", *optimizer_kinds(trainer)):
            start, flat = source(index, kind)
            prefix = "model." if kind == "model" else f"optim.{kind}."
            for slot in unit.slots:
                lo = max(slot.offset, start)
                hi = min(slot.offset + slot.numel, start + flat.numel())
                if lo >= hi:
                    continue
                name = full_name(trainer, slot)
                chunks = FlatChunks.from_flat(slot.shape, flat[lo - start:hi - start],
                                              lo - slot.offset)
                if experts is not None and experts.is_expert(slot.name):
                    chunks = tp_chunks(chunks, experts.params[slot.name], trainer.ep_rank,
                                       experts.ep)
                split = None if tp is None else tp.params.get(name, tp.params.get(slot.name))
                if split is not None:
                    chunks = tp_chunks(chunks, split, trainer.tp_rank, tp.tp)
                out[prefix + name] = chunks
    return out


def tp_chunks(chunks: FlatChunks, split: ParamShard, rank: int, tp: int) -> FlatChunks:
    """Chunks of tp rank `rank`'s slice of a parameter, as chunks of the full parameter.

    The slice is the rank-th 1/tp of every segment of the split dim,
    concatenated (`ParamShard.local`): each box is cut at segment borders
    and each piece moved to where its segment's share sits in the full tensor.
    """
    dim = split.dim
    width = [size // tp for size in split.segments]  # each segment's share per rank
    local_starts = [sum(width[:j]) for j in range(len(width))]
    full_starts = [sum(split.segments[:j]) + rank * width[j] for j in range(len(width))]
    rows = split.full_shape[dim]  # padding rows (`ParamShard.pad`) are not saved
    pieces = []
    for offsets, tensor in chunks.pieces.items():
        lo, hi = offsets[dim], offsets[dim] + tensor.shape[dim]
        for local, full, n in zip(local_starts, full_starts, width):
            a, b = max(lo, local), min(hi, local + n, local + rows - full)
            if a < b:
                moved = list(offsets)
                moved[dim] = full + a - local
                pieces.append((moved, tensor.narrow(dim, a - lo, b - a)))
    return FlatChunks(split.full_shape, pieces)


def adam_step(trainer) -> torch.Tensor | None:
    """AdamW's update count (one tensor the units share), or None for SGD."""
    if trainer.plan.train.optimizer.name != "adamw":
        return None
    return trainer.optimizer.inner.state[trainer.units[0].master]["step"]


def _fp8_state(trainer) -> dict[str, torch.Tensor]:
    """The float8 amax histories the rank writes (none without train.dtype = fp8)."""
    return saved_histories(trainer) if trainer.plan.train.dtype == "fp8" else {}


def _rng_state(rank: int) -> dict[str, torch.Tensor]:
    state = {f"rng.{rank}.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[f"rng.{rank}.cuda"] = torch.cuda.get_rng_state()
    return state


class Snapshot:
    """Host copies of what a rank writes, allocated once and refilled at every async save.

    Reusing the buffers keeps host memory flat however many saves a run
    makes; pinned memory (on GPUs) makes the device-to-host copy fast.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        pin = trainer.device.type == "cuda"
        own = owned(trainer)
        # (host buffer, live view): the optimizer updates its state in place, and a restore
        # loads into it, so the live tensors stay the same for the whole run.
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        buffers: dict[tuple[int, str], tuple[int, torch.Tensor]] = {}
        for index in range(len(trainer.units)):
            for kind in ("model", *optimizer_kinds(trainer)):
                start, live = own(index, kind)
                buffer = torch.empty(live.numel(), dtype=live.dtype, pin_memory=pin)
                buffers[(index, kind)] = (start, buffer)
                self.pairs.append((buffer, live))
        self.chunks = chunked_state(trainer, lambda i, k: buffers[(i, k)])
        self.step = torch.zeros((), dtype=torch.float32)

    def take(self) -> dict[str, Any]:
        """Copy the trainer's state into the buffers; the state dict to save from them."""
        for buffer, live in self.pairs:
            buffer.copy_(live, non_blocking=True)
        if self.trainer.device.type == "cuda":
            torch.cuda.synchronize(self.trainer.device)  # the writer thread reads the buffers
        state: dict[str, Any] = dict(self.chunks)
        step = adam_step(self.trainer)
        if step is not None:
            state["optim.step"] = self.step.copy_(step)
        state.update(_rng_state(self.trainer.rank))
        state.update(_fp8_state(self.trainer))
        return state


class _Prestaged:
    """DCP stager for a state dict that already is a private host copy (`Snapshot`)."""

    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class Checkpointer:
    """Saves and restores one Trainer's checkpoints in a CheckpointStore (collective calls)."""

    def __init__(self, trainer, store: CheckpointStore, *, group: dist.ProcessGroup,
                 keep: int, async_save: bool, log: Callable[[str], None] = print):
        """`group`: a gloo group of all ranks used only by checkpointing (and its thread)."""
        self.trainer, self.store, self.group = trainer, store, group
        self.keep, self.async_save, self.log = keep, async_save, log
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._snapshot: Snapshot | None = None
        self._pending: Future | None = None
        self._pending_step: int | None = None
        self.saved_step: int | None = None
        """The newest step whose save every rank knows was published (None: none yet)."""

    # ------------------------------------------------------------------ saving

    def save(self, step: int, position: int, info: Mapping[str, Any]) -> bool:
        """Checkpoint the state after `step` steps; False when the weights are not finite
        or (synchronous) the save failed.

        Asynchronous when configured: returns once the state is copied to
        host memory. Waits for the previous save first.
        """
        self.wait()
        bad = nonfinite_ranks([u.master for u in self.trainer.units], device=self.trainer.device)
        if bad:
            self.log(f"step {step}: non-finite weights on rank(s) {list(bad)}: not checkpointed")
            return False
        ensure_optimizer_state(self.trainer)
        writer_type = _FailingWriter if faults.save_fails(self.rank, step) else FileSystemWriter
        writer = writer_type(self.store.partial_path(step))
        manifest = dict(step=step, position=position, info={**info, "world": self.world})
        if not self.async_save:
            state = {**chunked_state(self.trainer, owned(self.trainer)),
                     **_rng_state(self.trainer.rank), **_fp8_state(self.trainer)}
            if adam_step(self.trainer) is not None:
                state["optim.step"] = adam_step(self.trainer)
            try:
                dcp.save(state, storage_writer=writer, planner=SavePlanner(),
                         process_group=self.group)
                self._finalize(manifest)
                error = None
            except SAVE_ERRORS as exc:
                error = exc
            return self._settle(step, error)
        if self._snapshot is None:
            self._snapshot = Snapshot(self.trainer)
        upload = dcp.async_save(self._snapshot.take(), storage_writer=writer,
                                planner=SavePlanner(), process_group=self.group,
                                async_stager=_Prestaged())
        done: Future = Future()

        def finish(future: Future) -> None:  # runs on DCP's writer thread
            try:
                future.result()
                self._finalize(manifest)
                done.set_result(step)
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread
                done.set_exception(exc)

        upload.add_done_callback(finish)
        self._pending, self._pending_step = done, step
        return True

    def _finalize(self, manifest: dict) -> None:
        """Checksum (split over ranks), then rank 0 checks, publishes and prunes."""
        path = self.store.partial_path(manifest["step"])
        names = sorted(p.name for p in path.iterdir()) if self.rank == 0 else None
        shared = [names]
        dist.broadcast_object_list(shared, src=0, group=self.group)
        mine = {name: digest(path / name) for name in shared[0][self.rank::self.world]}
        parts = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, parts, dst=0, group=self.group)
        if self.rank != 0:
            return
        files = {name: value for part in parts for name, value in part.items()}
        _check_index(path, files)
        final = self.store.publish(Manifest(files=files, **manifest))
        pruned = self.store.prune(self.keep)
        self.log(f"checkpoint {final.name} saved" +
                 (f" (removed {', '.join(step_name(s) for s in pruned)})" if pruned else ""))

    def wait(self) -> None:
        """Block until the save in flight (if any) is published or has failed on some rank
        (then say so: training goes on, `saved_step` stays)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
            error = None
        except SAVE_ERRORS as exc:
            error = exc
        self._settle(self._pending_step, error)

    def _settle(self, step: int, error: BaseException | None) -> bool:
        """Agree over the ranks whether the save of `step` was published (collective);
        when a rank's part failed, rank 0 removes the partial save and says which rank and
        why. True when it was published."""
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, None if error is None else _failure(error, self.rank),
                               group=self.group)
        failed = sorted(f for f in everyone if f is not None)
        if not failed:
            self.saved_step = step
            return True
        if self.rank == 0:
            shutil.rmtree(self.store.partial_path(step), ignore_errors=True)
            kept = "none yet" if self.saved_step is None else step_name(self.saved_step)
            rank, why = failed[0]
            self.log(f"step {step}: checkpoint not saved (rank {rank}: {why}); the latest "
                     f"stays {kept}; training goes on and the next save tries again")
        return False

    def close(self, *, failing: bool = False) -> None:
        """Finish the save in flight. `failing`: this rank is stopping on an error, and the
        others may not reach this call: wait for the save without agreeing on it."""
        if not failing:
            self.wait()
            return
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.exception()  # done, whichever way

    # --------------------------------------------------------------- restoring

    def restore(self) -> Manifest | None:
        """Load the newest intact visible checkpoint into the trainer; None when there is none.

        Every rank verifies a share of the files; a damaged checkpoint is
        set aside (`.damaged`), reported, and the previous one is tried.
        """
        self.wait()
        candidates = [self.store.visible() if self.rank == 0 else None]
        dist.broadcast_object_list(candidates, src=0, group=self.group)
        for step in candidates[0]:
            manifest, problems = self._verify(step)
            if not problems:
                self._load(step, manifest)
                self.saved_step = step
                return manifest
            if self.rank == 0:
                self.store.mark_damaged(step)
                self.log(f"checkpoint {step_name(step)} is damaged ({'; '.join(problems[:3])}); "
                         f"set aside as {step_name(step)}.damaged, trying the previous one")
        return None

    def _verify(self, step: int) -> tuple[Manifest | None, list[str]]:
        found: list[Any] = [None, []]
        if self.rank == 0:
            try:
                found[0] = self.store.manifest(step)
                if found[0].step != step:
                    found[1] = [f"manifest says step {found[0].step}"]
            except CheckpointError as exc:
                found[1] = [str(exc)]
        dist.broadcast_object_list(found, src=0, group=self.group)
        manifest, problems = found
        if manifest is None or problems:
            return manifest, problems
        names = sorted(manifest.files)[self.rank::self.world]
        mine = check_files(self.store.path(step), manifest.files, names)
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.group)
        return manifest, [p for part in everyone for p in part]

    def _load(self, step: int, manifest: Manifest) -> None:
        trainer = self.trainer
        path = self.store.path(step)
        trainer.settle_copies()  # no copy may still read a master we overwrite
        ensure_optimizer_state(trainer)
        state: dict[str, Any] = dict(chunked_state(trainer, held(trainer)))
        count = adam_step(trainer)
        if count is not None:
            state["optim.step"] = torch.zeros((), dtype=torch.float32)
        metadata = FileSystemReader(path).read_metadata()
        saved = manifest.info.get("layout", {})
        p = trainer.plan.parallel
        if (saved.get("tp"), saved.get("cp", 1), saved.get("pp"), saved.get("dp")) == \
                (p.tp, p.cp, p.pp, p.dp):
            # Each rank's generators continue (a CUDA state only if one was saved).
            state.update({k: v for k, v in _rng_state(trainer.rank).items()
                          if k in metadata.state_dict_metadata})
        _check_compatible(metadata, state, path)
        histories = {} if trainer.plan.train.dtype != "fp8" else history_reads(
            trainer, saved, {k: tuple(m.size) for k, m in metadata.state_dict_metadata.items()
                             if hasattr(m, "size")})
        state.update(histories)
        dcp.load(state, storage_reader=FileSystemReader(path), planner=LoadPlanner(),
                 process_group=self.group)
        if trainer.plan.train.dtype == "fp8" and not restore_histories(trainer, histories):
            self.log(f"{step_name(step)} holds no float8 amax history: delayed scaling "
                     f"starts afresh (its first step scales as current)")
        if count is not None:
            for unit in trainer.units:
                trainer.optimizer.inner.state[unit.master]["step"].copy_(state["optim.step"])
        if f"rng.{trainer.rank}.cpu" in state:
            torch.set_rng_state(state[f"rng.{trainer.rank}.cpu"])
            if f"rng.{trainer.rank}.cuda" in state:
                torch.cuda.set_rng_state(state[f"rng.{trainer.rank}.cuda"])
        else:  # a new layout: fresh streams per resume step, shared by a tp group (as at start)
            leader = dist.get_process_group_ranks(trainer.tp_group)[0] if trainer.tp_group \
                else trainer.rank
            torch.manual_seed(trainer.plan.runtime.seed + leader + self.world * step)
        publish(trainer.units, zero=trainer.zero)


def _failure(error: BaseException, rank: int) -> tuple[int, str]:
    """(the rank whose part failed, its error's first line) of a failed save: DCP's
    CheckpointException, which every rank raises, names the ranks that failed."""
    if isinstance(error, dcp.CheckpointException) and error.failures:
        rank, (error, _) = min(error.failures.items())
    return rank, f"{type(error).__name__}: {error}".splitlines()[0]


class _FailingWriter(FileSystemWriter):
    """A writer whose every write fails as a full disk does (the `savefail` test fault)."""

    def write_data(self, plan, planner):  # noqa: D102 - StorageWriter protocol
        raise OSError(28, "No space left on device (injected)")


def _check_index(path: Path, files: Mapping[str, tuple[int, int]]) -> None:
    """Verify what DCP wrote: its index reads back and names only files of full length."""
    metadata = FileSystemReader(path).read_metadata()
    for index, info in (metadata.storage_data or {}).items():
        name = str(info.relative_path)
        if name not in files or files[name][0] < info.offset + info.length:
            raise CheckpointError(f"{path.name}: {index.fqn} points past the end of {name}")


def _check_compatible(metadata, state: Mapping[str, Any], path: Path) -> None:
    """Fail clearly when the checkpoint does not hold this model (a plan error, not damage)."""
    saved = metadata.state_dict_metadata
    missing = sorted(k for k in state if k not in saved)
    if missing:
        raise CheckpointError(f"{path.name} lacks {len(missing)} tensors the plan needs, "
                              f"e.g. {missing[:3]} (another model or optimizer?)")
    for key, value in state.items():
        if isinstance(value, FlatChunks) and tuple(saved[key].size) != tuple(value.shape):
            raise CheckpointError(f"{path.name}: {key} has shape {tuple(saved[key].size)}, "
                                  f"the plan's model needs {tuple(value.shape)}")


def checkpoint_group(timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A gloo group of all ranks for checkpointing only (collective: every rank calls it)."""
    return dist.new_group(backend="gloo", timeout=timeout)
