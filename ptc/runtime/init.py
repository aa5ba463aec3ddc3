"""Initial weights and buffers: the same full tensors whatever the parallel layout.

The runtime builds no model of its own: the model and the initial value of
each parameter come from a `ModelFactory` handed in from above (`ptc.models`'
`build_model` and `initial_value`, given by `ptc.worker` and `ptc.api`).

- random(seed), built-in family: each parameter from the factory's `initial_value`
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import fx, nn

from ptc.compiler.graph.meta import graph_info
from ptc.compiler.records.params import ParamLayout
from ptc.errors import PtcError
from ptc.plan import Plan
from ptc.runtime.hf_weights import SafetensorsState


ModelBuilder = Callable[..., nn.Module]
"""`build(spec, device=..., seed=...)`: the model a plan's model section describes, on
`device`, its weights (off meta) from `seed` (`ptc.models.build_model`)."""

InitialValue = Callable[[nn.Module, str, int], torch.Tensor]
"""`initial_value(model, name, seed)`: the full fp32 CPU tensor parameter `name` of `model`
(built on meta) starts from (`ptc.models.initial_value`)."""


@dataclass(frozen=True, slots=True)
class ModelFactory:
    """Where a run's models and initial weights come from, handed in from above
    (`ModelFactory(ptc.models.build_model, ptc.models.initial_value)`): the runtime runs a
    Program and builds no model of its own. Both are module-level functions, so the record
    travels to spawned workers by name."""

    build: ModelBuilder
    """Builds the plan's model (`ModelBuilder`)."""
    initial_value: InitialValue
    """A parameter's initial value, computed from the model on meta (`InitialValue`)."""


def tensor_bytes(model: nn.Module, *, meta: bool = True) -> int:
    """Bytes of `model`'s parameters and buffers, each tied tensor once; `meta`: counting
    those on the meta device (a model built there for its sizes), else only those that hold
    values (what pickling the module sends)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers()) if meta or not t.is_meta}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def reference_model(plan: Plan, build: ModelBuilder) -> nn.Module:
    """The model whose names, init rules and buffers the weights follow, made by `build`: a
    built-in family's on meta; a custom factory's on the CPU under the seed where its own
    init gives the weights (random), else with only its buffers real and its parameters on
    meta (the weights come from the file), so that no rank holds a whole model to read its
    buffers."""
    seed = plan.train.init.seed
    if plan.model.family != "custom":
        return build(plan.model, device="meta", seed=seed)
    if plan.train.init.kind == "random":
        return build(plan.model, device="cpu", seed=seed)
    with _parameters_on_meta():
        return build(plan.model, device="cpu", seed=seed)


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


def initial_params(plan: Plan, layout: ParamLayout, model: nn.Module,
                   initial_value: InitialValue) -> dict[str, torch.Tensor]:
    """Full fp32 CPU value of every parameter of `layout`, by canonical name: from the plan's
    weights file, else from `model` (`reference_model`, or the module the Program was
    compiled from), each parameter it holds on meta by `initial_value`."""
    init = plan.train.init
    if init.kind in ("state_dict", "hf"):
        return params_from_state_dict(_saved_state(plan), layout, source=init.path)
    if any(p.is_meta for p in model.parameters()):
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


def initial_buffers(gm: fx.GraphModule, plan: Plan, model: nn.Module) -> dict[str, torch.Tensor]:
    """Real values of the graph module's buffers (they are on meta after compile): a graph
    constant, the state dict's, `model`'s own (`reference_model`, or the module the Program
    was compiled from), or for one on the meta device what `_MetaBuffers` recomputes."""
    names = [name for name, _ in gm.named_buffers()]
    if not names:
        return {}
    state = _saved_state(plan) if plan.train.init.kind in ("state_dict", "hf") else {}
    constants = graph_info(gm).constants
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
