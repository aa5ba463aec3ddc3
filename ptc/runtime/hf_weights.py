"""Hugging Face weights in: a `save_pretrained` directory read as one full state dict.

`init = hf("dir")` starts training from the weights `transformers` wrote:
`model.safetensors`, or the shards that `model.safetensors.index.json`
lists. The tensors are read lazily, one at a time, by the names the module
itself uses; the runtime then keeps of each parameter the part the rank's
layout holds. A tied weight saved once (the LM head) is found under any of
its names. Where `save_pretrained` writes a tensor in another layout than the
module's (transformers 5 saves a mixture of experts' stacked experts one
expert at a time), the reader converts it back by transformers' own rules for
the model type, as `from_pretrained` does (`ptc.runtime.hf_conversion`): a
stacked tensor is built from its pieces when asked for.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from functools import cached_property
from pathlib import Path

from typing import TYPE_CHECKING

from safetensors import safe_open

from ptc.errors import PtcError
from ptc.runtime.hf_conversion import ConvertedNames, conversion_rules, convert

if TYPE_CHECKING:  # torch (and transformers' rules) load with the first name asked for
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
    """The tensors of a save_pretrained directory by the module's names, each read when
    asked for.

    Where transformers converts the saved tensors on load (a mixture of experts' stacked
    experts, saved one expert at a time), the names are the module's, after transformers'
    own rules for the directory's model type (`ptc.runtime.hf_conversion`), and a
    converted tensor is built from its pieces when asked for; its shape is known without
    reading them. Elsewhere the names are those saved."""

    def __init__(self, path: str | Path):
        self.path = str(path)
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
        self._config: object = None

    @cached_property
    def _names(self) -> ConvertedNames | None:
        """The module's names under transformers' conversion rules for the directory's
        config.json, made on the first name asked for; None: the file's names as saved."""
        config = self._config_json()
        rules = conversion_rules(config) if config else None
        return ConvertedNames(self._files, rules) if rules else None

    def _config_json(self) -> dict:
        try:
            config = json.loads((self.root / "config.json").read_text())
        except (OSError, ValueError):
            return {}
        return config if isinstance(config, dict) else {}

    def _read(self, key: str) -> torch.Tensor:
        with safe_open(self._files[key], framework="pt") as f:
            return f.get_tensor(key)

    def _header(self, key: str) -> tuple[tuple[int, ...], str]:
        with safe_open(self._files[key], framework="pt") as f:
            piece = f.get_slice(key)
            return tuple(piece.get_shape()), piece.get_dtype()

    def _file_key(self, name: str) -> str | None:
        """The file key that holds module tensor `name` as it is; None for a converted one
        (or none at all)."""
        names = self._names
        if names is None:
            return name if name in self._files else None
        return names.plain.get(name)

    def _convert(self, name: str, read) -> torch.Tensor:
        """Converted module tensor `name` from the file tensors `read` gives; PtcError
        naming it when its pieces are incomplete or the conversion fails."""
        group = self._names.groups[name]
        where = f"train.init: hf(\"{self.path}\"): {name}"
        if group.problem:
            raise PtcError(f"{where}: {group.problem}; it is made of "
                           f"{sum(map(len, group.sources.values()))} saved tensors, e.g. "
                           f"{next(iter(group.sources.values()))[0]}")
        try:
            return convert(group, read, self._transformers_config())[name]
        except Exception as exc:  # noqa: BLE001 - any failure of transformers' operations
            text = str(exc).splitlines()[0] if str(exc) else ""
            raise PtcError(f"{where}: transformers' conversion of its saved tensors "
                           f"({', '.join(group.sources)}) failed: {type(exc).__name__}: "
                           f"{text}") from None

    def _transformers_config(self) -> object:
        """The directory's config as transformers reads it, for the conversions that ask
        for one (None where it cannot be read)."""
        if self._config is None:
            try:
                from transformers import AutoConfig  # noqa: PLC0415

                self._config = AutoConfig.from_pretrained(self.root)
            except Exception:  # noqa: BLE001 - a config transformers cannot read
                self._config = False
        return self._config or None

    def __getitem__(self, name: str) -> torch.Tensor:
        key = self._file_key(name)
        if key is not None:
            return self._read(key)
        if self._names is None or name not in self._names.groups:
            raise KeyError(name)
        return self._convert(name, self._read)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        return name in self._files if self._names is None else name in self._names

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name`, from the files' headers (no data is loaded): a
        converted one's by converting meta tensors of its pieces' shapes."""
        key = self._file_key(name)
        if key is not None:
            return self._header(key)[0]
        if self._names is None or name not in self._names.groups:
            raise KeyError(name)
        import torch  # noqa: PLC0415

        dtypes = _dtypes()

        def meta(key: str) -> torch.Tensor:
            shape, dtype = self._header(key)
            return torch.empty(shape, dtype=dtypes.get(dtype, torch.float32), device="meta")

        return tuple(self._convert(name, meta).shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files if self._names is None else self._names.names())

    def __len__(self) -> int:
        return len(self._files) if self._names is None else len(self._names.names())


def _dtypes() -> dict[str, torch.dtype]:
    """torch's dtypes by safetensors' names for them."""
    import torch  # noqa: PLC0415

    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
            "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
            "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
