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
them, else are recomputed by their module's `reset_buffers()`.
"""

from __future__ import annotations

import contextlib
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
    """Real values of the graph module's buffers (they are on meta after compile)."""
    names = [name for name, _ in gm.named_buffers()]
    if not names:
        return {}
    state = _saved_state(plan) if plan.train.init.kind in ("state_dict", "hf") else {}
    constants = graph_info(gm).constants
    model = model if model is not None else reference_model(plan)
    values = {}
    for name in names:
        if name in constants:
            values[name] = constants[name]
            continue
        if name in state:
            values[name] = state[name]
            continue
        owner, buffer = _owner_and_buffer(model, name)
        if buffer.is_meta:
            owner.to_empty(device="cpu", recurse=False)
            owner.reset_buffers()
            buffer = _owner_and_buffer(model, name)[1]
        values[name] = buffer
    return values


def check_buffers(gm: fx.GraphModule, plan: Plan, model: nn.Module) -> None:
    """PtcError when `initial_buffers` could not give some buffer of `gm` a value from
    `model` (one on the meta device, in no state dict, its owner without reset_buffers()),
    found without changing `model`: run where the workers would each fail on it."""
    constants = graph_info(gm).constants
    state = _saved_state(plan) if plan.train.init.kind in ("state_dict", "hf") else {}
    for name, _ in gm.named_buffers():
        if name not in constants and name not in state:
            _owner_and_buffer(model, name)


def _owner_and_buffer(model: nn.Module, name: str) -> tuple[nn.Module, torch.Tensor]:
    """The module holding buffer `name` and the buffer; PtcError when it is on the meta
    device and its owner cannot compute it (no reset_buffers())."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    buffer = getattr(owner, leaf)
    if buffer.is_meta and not callable(getattr(owner, "reset_buffers", None)):
        raise PtcError(f"buffer {name} has no value: it is on the meta device, not in the "
                       f"state dict, and {type(owner).__name__} has no reset_buffers(); build "
                       "the module with real buffers (only its parameters may be on the meta "
                       "device)")
    return owner, buffer


def _saved_state(plan: Plan) -> Mapping[str, torch.Tensor]:
    """The full state dict a state_dict or hf init names, read lazily (a memory map or the
    safetensors' own index): a rank reads only the tensors it asks for."""
    init = plan.train.init
    if init.kind == "hf":
        return SafetensorsState(init.path)
    return torch.load(init.path, map_location="cpu", weights_only=True, mmap=True)
