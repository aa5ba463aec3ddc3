"""Hugging Face weights in: a `save_pretrained` directory read as one full state dict.

`init = hf("dir")` starts training from the weights `transformers` wrote:
`model.safetensors`, or the shards that `model.safetensors.index.json`
lists. The tensors are read lazily, one at a time, by the names the module
itself uses (what `save_pretrained` writes); the runtime then keeps of each
parameter the part the rank's layout holds. A tied weight saved once (the
LM head) is found under any of its names.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

from typing import TYPE_CHECKING

from safetensors import safe_open

from ptc.errors import PtcError

if TYPE_CHECKING:  # torch loads with the first tensor read: `ptc check` stays light
    import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def check_hf_dir(path: str | Path, *, field: str = "train.init") -> Path:
    """The directory, after checking it holds safetensors weights; PtcError naming `field`."""
    root = Path(path)
    if not root.is_dir():
        raise PtcError(f"{field}: hf(\"{path}\"): not a directory (expected what "
                       "save_pretrained wrote: config.json and model.safetensors)")
    if not (root / INDEX).is_file() and not (root / SINGLE).is_file():
        found = sorted(p.name for p in root.iterdir())[:6]
        raise PtcError(f"{field}: hf(\"{path}\"): no {SINGLE} or {INDEX} in it (found "
                       f"{found or 'nothing'}); save the model with save_pretrained "
                       "(safe_serialization is the default)")
    return root


class SafetensorsState(Mapping):
    """The tensors of a save_pretrained directory by name, each read when asked for."""

    def __init__(self, path: str | Path):
        self.root = check_hf_dir(path)
        if (self.root / INDEX).is_file():
            try:
                weight_map = json.loads((self.root / INDEX).read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise PtcError(f"train.init: {self.root / INDEX}: not a safetensors index "
                               f"({type(exc).__name__}: {exc})") from None
            self._files = {name: self.root / file for name, file in weight_map.items()}
        else:
            with safe_open(self.root / SINGLE, framework="pt") as f:
                self._files = dict.fromkeys(f.keys(), self.root / SINGLE)

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(self._files[name], framework="pt") as f:
            return f.get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name`, read from the file's header (no data is loaded)."""
        with safe_open(self._files[name], framework="pt") as f:
            return tuple(f.get_slice(name).get_shape())

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)
