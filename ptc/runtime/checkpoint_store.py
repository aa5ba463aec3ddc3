"""The checkpoint directory: names, manifests, the `latest` pointer, verification, keep-k.

Layout of `runtime.checkpoint_dir` (on a filesystem every node sees):

    step_00000120/            a published checkpoint
        .metadata             DCP's index: which file holds which chunk of which tensor
        __0_0.distcp, ...     each rank's shards, written by DCP's FileSystemWriter
        ptc.json              the manifest, written last (see `Manifest`)
    step_00000160.partial/    a save in progress, or one a crash interrupted
    step_00000080.damaged/    failed verification on resume; kept for inspection
    latest                    the name of the newest published checkpoint
    wandb_run_id              with runtime.wandb: the W&B run a resumed run continues

Publishing is write, verify, then point: DCP writes into `.partial`, the
manifest records every file's size and CRC-32, the directory is renamed to
its final name, and `latest` is replaced atomically (temporary file, fsync,
`os.replace`). A crash at any point leaves the previous `latest` valid.
*Visible* checkpoints are the published ones up to the step `latest` names:
a directory renamed but not yet pointed to is as invisible as a partial
one, and neither is ever loaded or counted by keep-k.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ptc.errors import PtcError

MANIFEST = "ptc.json"
LATEST = "latest"
PARTIAL = ".partial"
DAMAGED = ".damaged"
FORMAT = 1
"""Manifest format version; bumped when the layout of a checkpoint changes."""
_NAME = re.compile(r"^step_(\d{8,})$")
_CHUNK = 16 << 20  # CRC-32 in 16 MiB reads: bounded memory for files of any size


class CheckpointError(PtcError):
    """A checkpoint cannot be used: missing, incomplete, or damaged."""


def step_name(step: int) -> str:
    """The directory name of the checkpoint taken after `step` optimizer steps."""
    return f"step_{step:08d}"


def parse_step(name: str) -> int | None:
    """The step of a published checkpoint's directory name, None for any other name."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """What a checkpoint holds besides the tensors, and how to tell it is intact."""

    step: int
    """Steps completed when it was taken (training resumes at this step, 0-based)."""
    position: int
    """Index of the next training sample to read (the data position)."""
    files: Mapping[str, tuple[int, int]]
    """File name -> (bytes, CRC-32) of every file DCP wrote."""
    info: Mapping[str, Any] = field(default_factory=dict)
    """Layout, learning-rate schedule and anything else worth reading back (JSON values)."""

    def to_json(self) -> str:
        """The manifest as JSON text."""
        return json.dumps({"format": FORMAT, "step": self.step, "position": self.position,
                           "files": {n: list(v) for n, v in sorted(self.files.items())},
                           "info": dict(self.info)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse a manifest; raise CheckpointError when it is not one this version reads."""
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT:
                raise CheckpointError(f"manifest format {data.get('format')!r}, "
                                      f"this ptc reads {FORMAT}")
            return cls(step=int(data["step"]), position=int(data["position"]),
                       files={n: (int(b), int(c)) for n, (b, c) in data["files"].items()},
                       info=data.get("info", {}))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"unreadable manifest: {type(exc).__name__}: {exc}") from None


def digest(path: Path) -> tuple[int, int]:
    """(bytes, CRC-32) of a file."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return size, crc


def check_files(directory: Path, files: Mapping[str, tuple[int, int]],
                names: Iterable[str] | None = None) -> list[str]:
    """Problems of the named files (default: all) against their manifest entries; [] if intact."""
    problems = []
    for name in sorted(files if names is None else names):
        path = directory / name
        expected_size, expected_crc = files[name]
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        size = path.stat().st_size
        if size != expected_size:
            problems.append(f"{name} has {size} bytes, {expected_size} were written")
        elif digest(path)[1] != expected_crc:
            problems.append(f"{name} fails its CRC-32 check")
    return problems


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointStore:
    """One checkpoint directory. Only one process (rank 0) changes it; every rank may read it."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def path(self, step: int) -> Path:
        """Directory of the published checkpoint of `step`."""
        return self.root / step_name(step)

    def partial_path(self, step: int) -> Path:
        """Directory a save of `step` writes into before it is published."""
        return self.root / (step_name(step) + PARTIAL)

    def publish(self, manifest: Manifest) -> Path:
        """Make the partial checkpoint of `manifest.step` visible: manifest, rename, pointer."""
        partial, final = self.partial_path(manifest.step), self.path(manifest.step)
        _write_atomically(partial / MANIFEST, manifest.to_json())
        if final.exists():  # an unpublished leftover of a crashed run, never visible
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync_dir(self.root)
        self.point_to(manifest.step)
        return final

    def point_to(self, step: int) -> None:
        """Move the `latest` pointer to the checkpoint of `step` (atomically)."""
        _write_atomically(self.root / LATEST, step_name(step) + "\n")

    def latest(self) -> int | None:
        """The step `latest` names; None when there is no pointer or it names nothing valid."""
        try:
            return parse_step((self.root / LATEST).read_text().strip())
        except OSError:
            return None

    def published(self) -> list[int]:
        """Steps of every directory with a final name and a manifest, oldest first."""
        if not self.root.is_dir():
            return []
        steps = (parse_step(p.name) for p in self.root.iterdir() if (p / MANIFEST).is_file())
        return sorted(s for s in steps if s is not None)

    def visible(self) -> list[int]:
        """Steps of the visible checkpoints, newest first: published, up to the pointer."""
        latest = self.latest()
        steps = self.published()
        if latest is not None:
            steps = [s for s in steps if s <= latest]
        return steps[::-1]

    def manifest(self, step: int) -> Manifest:
        """The manifest of a published checkpoint."""
        try:
            return Manifest.from_json((self.path(step) / MANIFEST).read_text())
        except OSError as exc:
            raise CheckpointError(f"{step_name(step)}: {exc}") from None

    def verify(self, step: int) -> list[str]:
        """Every problem of a published checkpoint ([] when intact): manifest, sizes, CRCs."""
        try:
            manifest = self.manifest(step)
        except CheckpointError as exc:
            return [str(exc)]
        if manifest.step != step:
            return [f"manifest says step {manifest.step}"]
        return check_files(self.path(step), manifest.files)

    def mark_damaged(self, step: int) -> Path:
        """Set a checkpoint that failed verification aside, so it is never tried again."""
        target = self.root / (step_name(step) + DAMAGED)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(self.path(step), target)
        return target

    def clean(self) -> list[str]:
        """Remove partial saves and published-but-unpointed directories; return their names.

        Only safe when no save is in flight (at start-up).
        """
        latest = self.latest()
        removed = []
        for path in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            step = parse_step(path.name)
            unpointed = step is not None and latest is not None and step > latest
            if path.is_dir() and (path.name.endswith(PARTIAL) or unpointed):
                shutil.rmtree(path)
                removed.append(path.name)
        return removed

    def prune(self, keep: int) -> list[int]:
        """Delete all but the newest `keep` visible checkpoints; return the deleted steps.

        The checkpoint `latest` names is always kept, and nothing invisible
        counts: a partial save never pushes a complete checkpoint out.
        """
        latest = self.latest()
        doomed = [s for s in self.visible()[max(keep, 1):] if s != latest]
        for step in doomed:
            shutil.rmtree(self.path(step))
        return doomed
