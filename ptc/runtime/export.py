"""Trained weights out of a checkpoint: a torch state dict or a Hugging Face directory.

A ptc checkpoint keeps every parameter under one of its names at its full
shape (`ptc.runtime.checkpoint`), whatever layout wrote it, so one process
reads it back without a process group (DCP's `no_dist` load). The manifest
records the model section of the plan and every parameter's names, so

- `--torch FILE` writes a state dict under the module's own names (a tied
  weight under each of its names, the module's persistent buffers too),
  which `load_state_dict(strict=True)` takes;
- `--hf DIR` rebuilds the module from its factory, loads the weights into
  it and calls its own `save_pretrained`, so `from_pretrained(DIR)` gives
  the trained model.

The module is rebuilt by the `build` handed in (`ptc.models.build_model`,
given by `ptc.cli` and `ptc.api`): the runtime builds no model of its own.

Nothing half-written replaces a good file: each output is written beside
its target and renamed into place.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from ptc.errors import PtcError
from ptc.plan import ModelSpec
from ptc.runtime.checkpoint_store import MANIFEST, CheckpointStore, Manifest, parse_step

if TYPE_CHECKING:
    from ptc.runtime.init import ModelBuilder

PREFIX = "model."
"""Checkpoint keys of parameters: `model.{name}`."""


def model_record(spec: ModelSpec) -> dict[str, Any] | None:
    """The plan's model section as JSON values for the manifest; None when its factory
    arguments are not JSON (the module can then be exported from Python only)."""
    record = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "spans"}
    record["kwargs"] = dict(record["kwargs"])
    try:
        json.dumps(record)
    except (TypeError, ValueError):
        return None
    return record


def read_weights(checkpoint: str | os.PathLike) -> tuple[dict[str, torch.Tensor], Manifest]:
    """Every parameter of a checkpoint (a step directory, or a checkpoint_dir: its latest
    intact step) as full fp32 tensors by name, and its manifest."""
    step_dir = _step_dir(Path(checkpoint))
    store, step = CheckpointStore(step_dir.parent), parse_step(step_dir.name)
    problems = store.verify(step)
    if problems:
        raise PtcError(f"{step_dir}: damaged checkpoint: {problems[0]}")
    manifest = store.manifest(step)
    reader = FileSystemReader(step_dir)
    metadata = reader.read_metadata().state_dict_metadata
    state = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
             for key, meta in metadata.items() if key.startswith(PREFIX)}
    with warnings.catch_warnings():  # DCP warns that it loads in one process: it is meant to
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {key[len(PREFIX):]: value for key, value in state.items()}, manifest


def export_torch(checkpoint: str | os.PathLike, out: str | os.PathLike, *,
                 build: ModelBuilder, model: nn.Module | None = None) -> Path:
    """Write the checkpoint's weights as a state dict under the module's own names: those of
    `model`, else of the module `build` makes from the manifest's model section."""
    weights, manifest = read_weights(checkpoint)
    module = model if model is not None else _rebuild(manifest, build, what="--torch",
                                                      required=False)
    if module is not None:
        state = _loaded(module, weights, checkpoint).state_dict()
    else:
        names = manifest.info.get("names", {})
        state = {alias: weights[name] for name in weights for alias in names.get(name, [name])}
    target = Path(out)
    with _beside(target) as tmp:
        torch.save(state, tmp)
        os.replace(tmp, target)
    return target


def export_hf(checkpoint: str | os.PathLike, out: str | os.PathLike, *,
              build: ModelBuilder, model: nn.Module | None = None) -> Path:
    """Write the checkpoint's weights as a Hugging Face save_pretrained directory, through
    `model`'s own save_pretrained, else that of the module `build` makes from the manifest's
    model section."""
    weights, manifest = read_weights(checkpoint)
    module = model if model is not None else _rebuild(manifest, build, what="--hf",
                                                      required=True)
    if not callable(getattr(module, "save_pretrained", None)):
        raise PtcError(f"--hf: the model is a {type(module).__qualname__}, not a transformers "
                       "PreTrainedModel (it has no save_pretrained); use --torch FILE")
    _loaded(module, weights, checkpoint)
    target = Path(out)
    with _beside(target, directory=True) as tmp, _beside(target, directory=True) as old:
        module.save_pretrained(tmp)
        if target.exists():
            os.replace(target, old / target.name)  # the old directory goes only once replaced
        os.replace(tmp, target)
    return target


def step_directory(checkpoint: str | os.PathLike) -> tuple[Path, int]:
    """(directory, step) of what a checkpoint path names: a step directory itself, or the
    latest intact step of a checkpoint_dir. Resolved once, it is what an export reads and
    what its message names, even while training writes newer steps."""
    step_dir = _step_dir(Path(checkpoint))
    return step_dir, parse_step(step_dir.name)


def _step_dir(path: Path) -> Path:
    if (path / MANIFEST).is_file():
        return path
    if not path.is_dir():
        raise PtcError(f"{path}: no such checkpoint directory")
    store = CheckpointStore(path)
    steps = [s for s in store.visible() if not store.verify(s)]
    if not steps:
        raise PtcError(f"{path}: no intact checkpoint in it (a step directory holds {MANIFEST})")
    return store.path(steps[0])


def _rebuild(manifest: Manifest, build: ModelBuilder, *, what: str,
             required: bool) -> nn.Module | None:
    """The module the checkpoint trained, built again by `build` from the manifest's model
    section."""
    record = manifest.info.get("model")
    if record is None or (record["family"] == "custom" and not record.get("factory")):
        if not required:
            return None
        raise PtcError(f"{what}: the checkpoint does not say how to build its model (it was "
                       "given to ptc.compile as a module); export from Python: "
                       "ptc.export(CHECKPOINT, hf=DIR, model=module)")
    return build(ModelSpec(**record), device="cpu")


def _loaded(module: nn.Module, weights: Mapping[str, torch.Tensor], source) -> nn.Module:
    """`module` with every parameter set from `weights` (by any of its names), in the
    module's own dtype; PtcError when names or shapes disagree."""
    params = dict(module.named_parameters(remove_duplicate=False))
    by_id: dict[int, list[str]] = {}
    for name, p in params.items():
        by_id.setdefault(id(p), []).append(name)
    missing = []
    with torch.no_grad():
        for names in by_id.values():
            saved = next((n for n in names if n in weights), None)
            if saved is None:
                missing.append(names[0])
                continue
            param = params[names[0]]
            if tuple(param.shape) != tuple(weights[saved].shape):
                raise PtcError(f"{source}: {saved} has shape {tuple(weights[saved].shape)}, the "
                               f"module's {names[0]} is {tuple(param.shape)}")
            param.copy_(weights[saved])
    if missing:
        raise PtcError(f"{source}: the checkpoint has no weights for {missing[:4]}"
                       f"{' ...' if len(missing) > 4 else ''}: it was not trained from this model")
    return module


class _beside:
    """A temporary file or directory next to `target`, removed if still there on exit."""

    def __init__(self, target: Path, *, directory: bool = False):
        target.parent.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        if directory:
            self.path = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        else:
            fd, name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
            os.close(fd)
            self.path = Path(name)

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc) -> None:
        if self.path.is_dir():
            shutil.rmtree(self.path, ignore_errors=True)
        elif self.path.exists():
            self.path.unlink()
