"""A plan from a device mesh: what `ptc.compile(model, mesh)` compiles.

The mesh is a `torch.distributed.device_mesh.DeviceMesh` whose dimensions are named
after ptc's axes (tp, cp, dp, pp), or a mapping of those names to sizes, outermost
first as a DeviceMesh lists them. It fixes the parallel degrees and their order; the
rest comes from a plan given beside it, or else from defaults read off the model and
the machine:

- the model: its own module, priced as the architecture it is (a transformers model's
  class and config, `ptc.models.transformers_config`); its vocabulary and longest
  sequence from its config;
- the hardware: the mesh's device, a CPU (gloo) or the preset of the GPU found here;
- training: one sequence of the model's longest per micro-batch, as many micro-batches
  as the pipeline has stages, AdamW, fp32 on a CPU and bf16 on a GPU, one step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from torch import nn

from ptc.errors import PtcError
from ptc.plan import AXES, HardwareSpec, ModelSpec, ParallelSpec, Plan, TrainSpec
from ptc.presets import PRESETS


def mesh_axes(mesh: Any) -> dict[str, int]:
    """The axis sizes of `mesh` (a DeviceMesh or a mapping), outermost first; PtcError
    naming the dimension when one is not a ptc axis or not a positive whole number."""
    if isinstance(mesh, Mapping):
        axes = dict(mesh)
    elif not hasattr(mesh, "mesh_dim_names"):
        raise PtcError(f"ptc.compile(model, ...): a {type(mesh).__name__} is not a plan, a "
                       f"plan file, a DeviceMesh or a mapping of axis names to sizes")
    else:
        names = getattr(mesh, "mesh_dim_names", None)
        if not names:
            raise PtcError("ptc.compile(model, mesh): the mesh's dimensions have no names; "
                                f"name them after ptc's axes ({', '.join(AXES)}), e.g. "
                                "init_device_mesh(..., mesh_dim_names=(\"dp\", \"tp\"))")
        axes = dict(zip(names, mesh.mesh.shape))
    for name, size in axes.items():
        if name not in AXES:
            raise PtcError(f"ptc.compile(model, mesh): mesh dimension {name!r} is not an "
                                f"axis ptc splits; valid: {', '.join(AXES)}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise PtcError(f"ptc.compile(model, mesh): mesh dimension {name!r} has size "
                                f"{size!r}; a size is a whole number >= 1")
    return {name: int(size) for name, size in axes.items()}


def plan_for_mesh(model: nn.Module | None, mesh: Any, plan: Plan | None = None) -> Plan:
    """The plan `ptc.compile(model, mesh)` compiles (module docstring)."""
    axes = mesh_axes(mesh)
    world = 1
    for size in axes.values():
        world *= size
    order = tuple(reversed(axes)) + tuple(a for a in ("tp", "cp", "dp", "pp") if a not in axes)
    degrees = {axis: axes.get(axis, 1) for axis in AXES}
    if plan is not None:
        if plan.num_gpus != world:
            raise PtcError(f"ptc.compile(model, mesh, plan=...): the mesh has {world} "
                                f"devices, the plan's hardware {plan.num_gpus}")
        return dataclasses.replace(plan, parallel=dataclasses.replace(
            plan.parallel, **degrees, order=order))
    if model is None:
        raise PtcError("ptc.compile(None, mesh): give the model, or a plan (plan=...) "
                            "whose model section builds it")
    device = str(getattr(mesh, "device_type", "cuda" if _cuda() else "cpu"))
    spec = _model_spec(model)
    pp = degrees["pp"]
    dtype = "fp32" if device == "cpu" else "bf16"
    return Plan(model=spec, hardware=_hardware(device, world),
                parallel=ParallelSpec(**degrees, order=order, zero=1 if degrees["dp"] > 1 else 0),
                train=TrainSpec(seq_len=spec.max_seq, micro_batch=1, dtype=dtype,
                                global_batch=degrees["dp"] * pp))


def _cuda() -> bool:
    import torch  # noqa: PLC0415

    return torch.cuda.is_available()


def _model_spec(model: nn.Module) -> ModelSpec:
    """A custom model spec that rebuilds `model`'s architecture, with its vocabulary and
    longest sequence."""
    from ptc.models.transformers_config import factory_of  # noqa: PLC0415

    found = factory_of(model)
    if found is None:
        raise PtcError(
            f"ptc.compile(model, mesh): ptc prices a {type(model).__name__} by rebuilding it, "
            f"which it can do for a transformers model only; give a plan (plan=...) whose "
            f"model section names a factory that builds this module")
    factory, kwargs = found
    config = model.config
    vocab = getattr(config, "vocab_size", None)
    max_seq = getattr(config, "max_position_embeddings", None) \
        or getattr(config, "n_positions", None)
    if not vocab or not max_seq:
        raise PtcError(f"ptc.compile(model, mesh): {type(model).__name__}'s config gives "
                            f"no vocab_size or max_position_embeddings; give a plan (plan=...)")
    return ModelSpec(family="custom", factory=factory, kwargs=kwargs, vocab=vocab,
                     max_seq=max_seq)


def _hardware(device: str, world: int) -> HardwareSpec:
    """The hardware of `world` devices of type `device`: gloo processes on this CPU, or the
    preset of the GPU found here."""
    if device == "cpu":
        return HardwareSpec.preset("cpu", gpus_per_node=world)
    import torch  # noqa: PLC0415

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else device
    preset = gpu_preset(name)
    return HardwareSpec.preset(preset, gpus_per_node=min(world, PRESETS[preset].gpus_per_node),
                               nodes=max(1, world // PRESETS[preset].gpus_per_node))


def gpu_preset(device_name: str) -> str:
    """The preset of a GPU by the name torch gives it ("NVIDIA H100 80GB HBM3": H100-SXM);
    PtcError listing the presets when none or several fit."""
    words = device_name.upper().replace("-", " ").split()
    fits = [p for p in PRESETS if p != "cpu" and p.split("-")[0].upper() in words]
    if len(fits) > 1:  # A100-40GB or A100-80GB: the memory in the name says which
        fits = [p for p in fits if any(w in words for w in p.upper().split("-")[1:])] or fits
    if len(fits) != 1:
        raise PtcError(f"ptc.compile(model, mesh): no one hardware preset for GPU "
                            f"{device_name!r}; give a plan (plan=...) with its hardware "
                            f"section (presets: {', '.join(p for p in PRESETS if p != 'cpu')})")
    return fits[0]
