"""Initial weights and buffers: the same full tensors whatever the parallel layout.

- random(seed), built-in family: each parameter from `ptc.models.initial_value`
  (its own generator, seeded from the run seed and its name), computed from
  the meta model, so no rank ever materialises the whole model.
- random(seed), custom family: the user's factory run under the seed on CPU.
  With weights from a file, the factory's model is built with its
  parameters on meta and only its buffers real (`reference_model`).
- state_dict(path): a full (unsharded) `torch.save`d state dict, by parameter
  name; a tied weight may appear under any of its names.
- hf(dir): a Hugging Face `save_pretrained` directory, read lazily
  (`ptc.runtime.hf_weights`), by the same names.

Buffers the graph reads (RoPE tables) come from the state dict when it has
them, else from the module; one on the meta device is recomputed by its
module's `reset_buffers()`, or, in a Hugging Face model, by the model's class
built again from its config with its parameters on meta (`_MetaBuffers`).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import fx, nn

from ptc.compiler.meta import graph_info
from ptc.compiler.program import ParamLayout
from ptc.errors import PtcError
from ptc.plan import Plan
from ptc.runtime.hf_weights import SafetensorsState


def check_init(plan: Plan, *, factory: bool = True) -> None:
    """Refuse, in one line naming `train.init`, weights that cannot be read or that do not
    hold the model's parameters (names and shapes, against the model built on the meta
    device, which costs no memory) — run before any process starts. `factory`: whether the
    workers build a custom model from the plan's factory (not when they are sent a module,
    whose names are its own)."""
    init = plan.train.init
    if init.kind == "random":
        return
    if init.kind == "state_dict" and not Path(init.path).is_file():
        raise PtcError(f"train.init: state_dict(\"{init.path}\"): no such file")
    if init.kind == "hf":
        state = SafetensorsState(init.path)
        shape_of = state.shape
    else:
        try:
            state = torch.load(init.path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001 - a pickle, zip or format error of the file
            raise PtcError(f"train.init: state_dict(\"{init.path}\"): cannot be read as a "
                           f"torch.save state dict ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
        if not isinstance(state, Mapping):
            raise PtcError(f"train.init: state_dict(\"{init.path}\") holds a "
                           f"{type(state).__name__}, not a state dict")
        def shape_of(name: str) -> tuple[int, ...]:
            return tuple(state[name].shape)
    if plan.model.family == "custom" and not factory:
        return  # the workers are sent the module: its names are not the factory's
    from ptc.models import build_model  # noqa: PLC0415 - only the runtime needs models here

    try:
        model = build_model(plan.model, device="meta")
    except Exception:  # noqa: BLE001 - a factory that fails: the factory check says why
        if plan.model.family != "custom":
            raise
        return
    _check_names_and_shapes(model, state, shape_of, init.path)


def _check_names_and_shapes(model: nn.Module, state: Mapping, shape_of, source: str) -> None:
    """Every parameter of `model` under one of its names (tied ones have several) in `state`,
    with the model's shape."""
    names: dict[int, list[str]] = {}
    params = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        params[id(param)] = param
    missing = []
    for key, aliases in names.items():
        found = next((a for a in aliases if a in state), None)
        if found is None:
            missing.append(aliases[0])
            continue
        want = tuple(params[key].shape)
        if shape_of(found) != want:
            raise PtcError(f"train.init: {source}: {found} has shape {shape_of(found)}, the "
                           f"model needs {want}")
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4
                                          else "")
        raise PtcError(f"train.init: {source}: no weights for {shown} (of {len(names)} "
                       f"parameters); the file holds {len(state)} tensors, e.g. "
                       f"{', '.join(list(state)[:3])}")


def cpu_build_bytes(plan: Plan) -> int:
    """Bytes of the model each rank builds whole on the CPU to take its part of the initial
    weights (`reference_model`): a custom factory's with init = random, whose values are its
    own init under the seed; 0 otherwise (a built-in family's values are made parameter by
    parameter, a file's read in parts). Measured on the factory's model built on meta."""
    if plan.model.family != "custom" or plan.train.init.kind != "random":
        return 0
    from ptc.models import build_model  # noqa: PLC0415 - only the runtime needs models here

    try:
        model = build_model(plan.model, device="meta")
    except Exception:  # noqa: BLE001 - a factory that fails: the factory check says why
        return 0
    return tensor_bytes(model)


def tensor_bytes(model: nn.Module, *, meta: bool = True) -> int:
    """Bytes of `model`'s parameters and buffers, each tied tensor once; `meta`: counting
    those on the meta device (a model built there for its sizes), else only those that hold
    values (what pickling the module sends)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers()) if meta or not t.is_meta}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def reference_model(plan: Plan) -> nn.Module:
    """The model whose names, init rules and buffers the weights follow: a built-in family's
    on meta; a custom factory's on the CPU under the seed where its own init gives the
    weights (random), else with only its buffers real and its parameters on meta (the
    weights come from the file), so that no rank holds a whole model to read its buffers."""
    from ptc.models import build_model  # noqa: PLC0415 - only the runtime needs models here

    seed = plan.train.init.seed
    if plan.model.family != "custom":
        return build_model(plan.model, device="meta", seed=seed)
    if plan.train.init.kind == "random":
        return build_model(plan.model, device="cpu", seed=seed)
    with _parameters_on_meta():
        return build_model(plan.model, device="cpu", seed=seed)


@contextlib.contextmanager
def _parameters_on_meta():
    """Within: each parameter a module registers is moved to the meta device as it is
    registered (one parameter on the CPU at a time), while buffers stay where the module's
    code makes them (a rotary table computed from its config)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def initial_params(plan: Plan, layout: ParamLayout,
                   model: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """Full fp32 CPU value of every parameter of `layout`, by canonical name."""
    init = plan.train.init
    if init.kind in ("state_dict", "hf"):
        return params_from_state_dict(_saved_state(plan), layout, source=init.path)
    model = model if model is not None else reference_model(plan)
    if any(p.is_meta for p in model.parameters()):
        from ptc.models import initial_value  # noqa: PLC0415

        names = {n for n, _ in model.named_parameters()}
        return {slot.name: initial_value(model, next(a for a in slot.aliases if a in names),
                                         init.seed)
                for slot in layout.params.values()}
    return params_from_state_dict(model.state_dict(), layout, source="the model")


def params_from_state_dict(state: Mapping[str, torch.Tensor], layout: ParamLayout, *,
                           source: str) -> dict[str, torch.Tensor]:
    """Pick every layout parameter out of a full state dict, checking names and shapes."""
    values, missing = {}, []
    for slot in layout.params.values():
        name = next((a for a in slot.aliases if a in state), None)
        if name is None:
            missing.append(slot.name)
            continue
        value = state[name]
        if tuple(value.shape) != slot.shape:
            raise PtcError(f"{source}: {name} has shape {tuple(value.shape)}, "
                           f"the model needs {slot.shape}")
        values[slot.name] = value.detach().to("cpu", torch.float32)
    if missing:
        raise PtcError(f"{source}: missing parameters {missing}")
    return values


def initial_buffers(gm: fx.GraphModule, plan: Plan,
                    model: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """Real values of the graph module's buffers (they are on meta after compile): a graph
    constant, the state dict's, the module's own, or for one on the meta device what
    `_MetaBuffers` recomputes."""
    names = [name for name, _ in gm.named_buffers()]
    if not names:
        return {}
    state = _saved_state(plan) if plan.train.init.kind in ("state_dict", "hf") else {}
    constants = graph_info(gm).constants
    model = model if model is not None else reference_model(plan)
    meta = _MetaBuffers(model)
    values = {}
    for name in names:
        if name in constants:
            values[name] = constants[name]
        elif name in state:
            values[name] = state[name]
        else:
            buffer = model.get_buffer(name)
            values[name] = meta.value(name) if buffer.is_meta else buffer
    return values


def check_buffers(gm: fx.GraphModule, plan: Plan, model: nn.Module) -> None:
    """PtcError when `initial_buffers` could not give some buffer of `gm` a value from
    `model` (one on the meta device, in no state dict, that `_MetaBuffers` cannot
    recompute), found without changing `model`: run where the workers would each fail on
    it."""
    constants = graph_info(gm).constants
    state = _saved_state(plan) if plan.train.init.kind in ("state_dict", "hf") else {}
    meta = _MetaBuffers(model)
    for name, _ in gm.named_buffers():
        if name not in constants and name not in state and model.get_buffer(name).is_meta:
            meta.value(name, compute=False)


class _MetaBuffers:
    """Values of a module's buffers that are on the meta device, the one rule `initial_buffers`
    and `check_buffers` share, tried in order:

    - the owner's `reset_buffers()` (torch's convention: RoPE tables of ptc's models);
    - a Hugging Face `transformers` model (the nearest one around the owner: the user's
      wrapper may hold it) built again from its own config with its parameters on the meta
      device (`_parameters_on_meta`, no weights): the buffers its code computes from the
      config (a rotary table), cast to the buffer's dtype, as building the module on the CPU
      would have made them;
    - else a PtcError naming the buffer.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.rebuilt: dict[str, nn.Module] = {}

    def value(self, name: str, *, compute: bool = True) -> torch.Tensor | None:
        """The value of meta buffer `name`; `compute=False`: only check that there is one
        (the owner is left as it is; a transformers model is still rebuilt, its parameters
        on meta)."""
        owner_name, _, leaf = name.rpartition(".")
        owner = self.model.get_submodule(owner_name)
        buffer = owner.get_buffer(leaf)
        if callable(getattr(owner, "reset_buffers", None)):
            if not compute:
                return None
            owner.to_empty(device="cpu", recurse=False)
            owner.reset_buffers()
            return owner.get_buffer(leaf)
        found = self._from_config(name)
        if found is None or found.is_meta or found.shape != buffer.shape:
            raise PtcError(f"buffer {name} has no value: it is on the meta device, not in the "
                           f"state dict, {type(owner).__name__} has no reset_buffers() and no "
                           "transformers model around it computes it from its config; build "
                           "the module with real buffers (only its parameters may be on the "
                           "meta device)")
        return found.to(buffer.dtype)

    def _from_config(self, name: str) -> torch.Tensor | None:
        """Buffer `name` as the nearest transformers model holding it builds it from its
        config (parameters on meta); None without one."""
        transformers = sys.modules.get("transformers")  # imported where such a model exists
        if transformers is None:
            return None
        parts = name.split(".")
        for cut in range(len(parts) - 1, -1, -1):
            prefix = ".".join(parts[:cut])
            holder = self.model.get_submodule(prefix)
            if isinstance(holder, transformers.PreTrainedModel):
                if prefix not in self.rebuilt:
                    try:
                        with _parameters_on_meta():
                            self.rebuilt[prefix] = type(holder)(copy.deepcopy(holder.config))
                    except Exception:  # noqa: BLE001 - a class its config alone cannot build
                        return None
                try:
                    return self.rebuilt[prefix].get_buffer(".".join(parts[cut:]))
                except AttributeError:
                    return None
        return None


def _saved_state(plan: Plan) -> Mapping[str, torch.Tensor]:
    """The full state dict a state_dict or hf init names, read lazily (a memory map or the
    safetensors' own index): a rank reads only the tensors it asks for."""
    init = plan.train.init
    if init.kind == "hf":
        return SafetensorsState(init.path)
    return torch.load(init.path, map_location="cpu", weights_only=True, mmap=True)
