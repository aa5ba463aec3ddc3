"""In-memory snapshots: a restarted group resumes from host memory, losing no step.

A storage checkpoint costs a write to a shared file system and, after a
failure, a read back; taken every few hundred steps, every step since it is
trained again. `runtime { snapshot_every = N }` (Megatron-LM's local
checkpoints, Gemini's in-memory checkpoints) keeps, every N steps, what each
rank holds — its flat weight and optimizer buffers, Adam's step count, its
random generators' states, float8 amax histories, the step and the data
position — in host memory that outlives the process: a file on the node's
tmpfs (`/dev/shm/ptc-snapshots/<key of checkpoint_dir>/rank<r>.safetensors`).
Writing that file (from a GPU, after a copy to pinned host buffers; to a
temporary name, then renamed: a partial snapshot never replaces a whole one)
is the only pause training sees, and once it is done the snapshot outlives
the rank: a rank killed as the next step starts resumes from it. A
background thread then sends the same bytes to a peer, while the next step
trains, which keeps them as `rank<r>.peer.safetensors` on its own node: the
rank as many ranks on (LOCAL_WORLD_SIZE), on the next node; on one node, the
next rank.

A restarted group (`--max-restarts`) restores before it reads storage
(`restore`, collective): the ranks tell each other which snapshots they
hold, their own and their peers', and take the newest step every rank can
get — its own file, else its peer's copy, sent back to it — if it is no
older than the newest storage checkpoint. Each file carries a checksum and
the layout it was taken under; a snapshot that is damaged on any rank, or
of another layout (an elastic restart on fewer processes), is passed over
and the run resumes from storage. The state restored is the one the rank
held, bit for bit: the run continues exactly as an uninterrupted one. The
files are removed when the run ends well.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from ptc.runtime import faults
from ptc.runtime.checkpoint import adam_step, ensure_optimizer_state, held, optimizer_kinds
from ptc.runtime.fp8_state import restore_histories, saved_histories
from ptc.runtime.params import publish

ROOT_ENV = "PTC_SNAPSHOT_DIR"
"""Where snapshot folders live: this variable, else /dev/shm/ptc-snapshots (tmpfs)."""


def snapshot_root() -> Path:
    """Where every run's snapshot folder lives (`ROOT_ENV`)."""
    return Path(os.environ.get(ROOT_ENV) or "/dev/shm/ptc-snapshots")


def snapshot_folder(checkpoint_dir: str) -> Path:
    """The folder of the snapshots of the run that checkpoints into `checkpoint_dir`: a
    restarted group finds them again by it."""
    root = snapshot_root()
    key = hashlib.sha256(str(Path(checkpoint_dir).resolve()).encode()).hexdigest()[:16]
    return root / key


def peer_of(rank: int, world: int, local_world: int) -> int:
    """The rank that keeps `rank`'s copy: the same local rank on the next node, or on one
    node the next rank."""
    step = local_world if world > local_world else 1
    return (rank + step) % world


def live_state(trainer) -> dict[str, torch.Tensor]:
    """The buffers a snapshot copies, by name: each unit's flat weights and optimizer state
    as this rank holds them."""
    ensure_optimizer_state(trainer)
    hold = held(trainer)
    return {f"{index}.{kind}": hold(index, kind)[1] for index in range(len(trainer.units))
            for kind in ("model", *optimizer_kinds(trainer))}


def room_for_snapshots(trainer, folder: Path) -> tuple[int, int]:
    """(bytes the node's snapshots need, bytes free for them where they are kept): each of
    the node's ranks (LOCAL_WORLD_SIZE) keeps its own snapshot and a peer's, about its own
    size; the free space counts this run's snapshots already there, which the next ones
    replace."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    need = 2 * local * sum(t.numel() * t.element_size() for t in live_state(trainer).values())
    existing = folder if folder.exists() else next(p for p in folder.parents if p.exists())
    stat = os.statvfs(existing)
    ours = sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder.exists() else 0
    return need, stat.f_bavail * stat.f_frsize + ours


class MemorySnapshots:
    """One rank's snapshots (module docstring); collective where it says so."""

    def __init__(self, trainer, folder: Path, group: dist.ProcessGroup, *,
                 log: Callable[[str], None] = print):
        """`group`: a gloo group of all ranks for snapshots only (its thread sends peers'
        copies over it); `log`: where a damaged snapshot is reported. Collective: every rank
        constructs it."""
        self.trainer, self.folder, self.group, self.log = trainer, folder, group, log
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        self.peer = peer_of(self.rank, self.world, local)
        self.source = next(r for r in range(self.world) if peer_of(r, self.world, local)
                           == self.rank)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.live = live_state(trainer)
        self.host = {name: torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
                     for name, t in self.live.items()} if trainer.device.type == "cuda" else {}
        p = trainer.plan.parallel
        self.layout = json.dumps({"world": self.world, "rank": self.rank, "tp": p.tp, "cp": p.cp,
                                  "pp": p.pp, "dp": p.dp, "zero": p.zero,
                                  "sizes": {n: t.numel() for n, t in self.live.items()}},
                                 sort_keys=True)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ptc-snapshot")
        self._pending: Future | None = None

    def own_path(self, rank: int | None = None) -> Path:
        """The file of rank `rank`'s own snapshot (default this rank's)."""
        return self.folder / f"rank{self.rank if rank is None else rank}.safetensors"

    def peer_path(self, rank: int) -> Path:
        """The file of the copy this node keeps of `rank`'s snapshot."""
        return self.folder / f"rank{rank}.peer.safetensors"

    # ------------------------------------------------------------------ taking

    def take(self, step: int, position: int) -> None:
        """Snapshot the state after `step` steps (`position`: the next sample): write it to
        this node's host memory now — from here on it outlives the process — and replicate
        it to the peer in the background, while the next step trains."""
        self.wait()
        if self.trainer.device.type == "cuda":  # copied off the device first, then written
            for name, buffer in self.host.items():
                buffer.copy_(self.live[name], non_blocking=True)
            torch.cuda.synchronize(self.trainer.device)
            tensors = dict(self.host)
        else:  # already in host memory: written as they are, before the next step changes them
            tensors = dict(self.live)
        count = adam_step(self.trainer)
        if count is not None:
            tensors["adam_step"] = count.detach().cpu().clone().reshape(1)
        tensors["rng.cpu"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            tensors["rng.cuda"] = torch.cuda.get_rng_state()
        if self.trainer.plan.train.dtype == "fp8":
            tensors.update(saved_histories(self.trainer))
        meta = {"step": str(step), "position": str(position), "layout": self.layout,
                "crc": str(_checksum(tensors))}

        def write(path: str) -> None:
            save_file(tensors, path, metadata=meta)
            faults.at_phase("snapshot", self.rank, step)

        _write_atomically(self.own_path(), write)
        self._pending = self._writer.submit(self._replicate)

    def wait(self) -> None:
        """Block until the snapshot in flight is replicated; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _replicate(self) -> None:
        """Send this rank's newest snapshot to its peer and keep the one its source sends."""
        mine = torch.frombuffer(bytearray(self.own_path().read_bytes()), dtype=torch.uint8)
        theirs = _exchange(mine, self.peer, self.source, self.group)
        if theirs is not None:
            _write_atomically(self.peer_path(self.source),
                              lambda path: Path(path).write_bytes(theirs.numpy().tobytes()))

    def close(self, *, remove: bool) -> None:
        """Finish the snapshot in flight; `remove`: the run ended well, its snapshots (this
        rank's own and the copy it keeps) are not needed again."""
        self.wait()
        self._writer.shutdown()
        if remove:
            for path in (self.own_path(), self.peer_path(self.source)):
                path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # the last rank out removes the folder
                self.folder.rmdir()

    # --------------------------------------------------------------- restoring

    def restore(self, storage_step: int | None) -> tuple[int, int] | None:
        """Load the newest snapshot every rank can get, if no older than `storage_step` (the
        newest storage checkpoint); return its (step, position), else None (collective)."""
        held_here = (self._step_of(self.own_path()), self._step_of(self.peer_path(self.source)))
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, held_here, group=self.group)
        own = {r: everyone[r][0] for r in range(self.world)}
        kept = {r: everyone[self.peer_of_rank(r)][1] for r in range(self.world)}
        steps = sorted({s for s in (*own.values(), *kept.values()) if s is not None},
                       reverse=True)
        step = next((s for s in steps if all(own[r] == s or kept[r] == s
                                             for r in range(self.world))), None)
        if step is None or (storage_step is not None and step < storage_step):
            return None
        for r in range(self.world):  # a lost snapshot comes back from its peer's copy
            if own[r] != step:
                self._send_back(r, step)
        tensors, meta, problem = self._read(step)
        problems: list = [None] * self.world
        dist.all_gather_object(problems, problem, group=self.group)
        if any(problems):  # checked on every rank before any rank loads anything
            self.log(f"the in-memory snapshot of step {step} is not usable "
                     f"({'; '.join(p for p in problems if p)}): resuming from storage")
            return None
        self._apply(tensors)
        return step, int(meta["position"])

    def peer_of_rank(self, rank: int) -> int:
        """The rank that keeps `rank`'s copy."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        return peer_of(rank, self.world, local)

    def _step_of(self, path: Path) -> int | None:
        """The step of the snapshot in `path` when it is one of this layout, else None."""
        try:
            with safe_open(path, "pt") as f:
                meta = f.metadata()
        except (OSError, ValueError, RuntimeError):  # missing, or not a safetensors file
            return None
        layout = json.loads(meta.get("layout", "{}"))
        mine = json.loads(self.layout)
        if path.name.endswith(".peer.safetensors"):
            layout.pop("rank", None)
            mine.pop("rank", None)
            mine["sizes"] = layout.get("sizes")  # the peer's stage may hold other buffers
        return int(meta["step"]) if layout == mine else None

    def _send_back(self, rank: int, step: int) -> None:
        """The keeper of `rank`'s copy sends it to `rank`, which keeps it as its own file."""
        keeper = self.peer_of_rank(rank)
        if self.rank == keeper:
            data = torch.frombuffer(bytearray(self.peer_path(rank).read_bytes()), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
            dist.send(size, rank, group=self.group)
            dist.send(data, rank, group=self.group)
        elif self.rank == rank:
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, keeper, group=self.group)
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(data, keeper, group=self.group)
            _write_atomically(self.own_path(),
                              lambda path: Path(path).write_bytes(data.numpy().tobytes()))

    def _read(self, step: int) -> tuple[dict, dict, str | None]:
        """This rank's snapshot of `step`: (tensors, metadata, None), or the problem that
        makes it unusable (unreadable, another step, a checksum that does not match)."""
        try:
            with safe_open(self.own_path(), "pt") as f:
                meta = f.metadata()
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (OSError, ValueError, RuntimeError) as exc:
            return {}, {}, f"rank {self.rank}: {exc}"
        if int(meta["step"]) != step or str(_checksum(tensors)) != meta["crc"]:
            return {}, {}, f"rank {self.rank}: its snapshot of step {step} is damaged"
        return tensors, meta, None

    def _apply(self, tensors: dict[str, torch.Tensor]) -> None:
        """Put a snapshot's state back into the trainer, as it was when taken."""
        trainer = self.trainer
        trainer.settle_copies()
        for name, live in self.live.items():
            live.copy_(tensors[name])
        if adam_step(trainer) is not None:
            for unit in trainer.units:
                trainer.optimizer.inner.state[unit.master]["step"].copy_(
                    tensors["adam_step"].reshape(()))
        torch.set_rng_state(tensors["rng.cpu"])
        if "rng.cuda" in tensors:
            torch.cuda.set_rng_state(tensors["rng.cuda"])
        if trainer.plan.train.dtype == "fp8":
            restore_histories(trainer, {k: v for k, v in tensors.items() if k.startswith("fp8")})
        publish(trainer.units, zero=trainer.zero)


def _checksum(tensors: dict[str, torch.Tensor]) -> int:
    """CRC-32 over every tensor's bytes, in name order."""
    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(tensors[name].contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return crc


def _write_atomically(path: Path, write) -> None:
    """`write(temporary path)`, then rename it to `path`: never a partial file at `path`."""
    partial = path.with_name(f".{path.name}.partial")
    write(str(partial))
    os.replace(partial, path)


def _exchange(mine: torch.Tensor, peer: int, source: int, group) -> torch.Tensor | None:
    """Send `mine` to `peer` and receive `source`'s bytes (None when the peer is oneself)."""
    if peer == dist.get_rank():
        return None
    size = torch.tensor([mine.numel()], dtype=torch.int64)
    theirs_size = torch.zeros(1, dtype=torch.int64)
    works = [dist.isend(size, peer, group=group), dist.irecv(theirs_size, source, group=group)]
    for work in works:
        work.wait()
    theirs = torch.empty(int(theirs_size.item()), dtype=torch.uint8)
    works = [dist.isend(mine, peer, group=group), dist.irecv(theirs, source, group=group)]
    for work in works:
        work.wait()
    return theirs
