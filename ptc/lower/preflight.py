"""Before any process starts: everything a run needs that can be checked from here.

`ptc check` and `ptc run` (and `ptc.run`) ask the same questions, each
answered in one diagnostic that points at the plan field it concerns
(`plan.ptc:40:20: error: ... [runtime.checkpoint_dir]`, or `--runtime.
checkpoint_dir` when the value came from the command line):

- the token file exists and every id is below the vocabulary (`check_data`);
- the initial weights exist and hold the model's names and shapes (`check_init`, against
  the model built on meta);
- checkpoint_dir, and the folders of metrics and tensorboard, can be
  created and written (side-effect free: the nearest existing folder is
  asked, nothing is made);
- the wandb package is installed when `runtime.wandb` names a project
  (looked up, not imported: importing it takes seconds);
- a custom model's factory imports, and the model it builds can be captured and
  trained (an encoder whose attention sees later tokens cannot) and compiled
  under the plan's layout (an attention whose heads a norm mixes cannot be
  split by tensor parallelism without a shard rule), the error at the plan
  field that asked for the failing pass;
- train.dtype = fp8 has float8 matmuls to run on (CUDA compute capability
  8.9+; 9.0+ for fp8_recipe = rowwise; mxfp8 runs emulated only), unless
  train.fp8_emulate asks for emulation;
- a plan for GPUs (backend auto) on a machine without CUDA is said in a warning: its
  ranks would train on the CPU;
- train.dtype is not fp16: fp16 training needs loss scaling, which ptc's
  runtime does not do (gradients below fp16's smallest number would become
  zero); fp16 plans are priced by `ptc explain` and `ptc plan`, not run;
- the plan fits memory: the predicted peak of every pipeline stage is
  within the budget (built-in families, and custom models that ptc can
  profile), else an error naming the stage, the bytes over and what would
  fit (`allow_oom` turns it into a warning);
- the ranks of one host fit its memory where each holds a whole model on the
  CPU (a custom factory's built to take its own init, a module sent to
  every worker): else an error at train.init saying how to give the weights
  instead (`allow_oom` turns it into a warning).

The file and folder checks come first and need neither torch nor sympy: when
one fails, the answer comes before torch would have finished importing.

It is planning, not running: it estimates, builds models and compiles, so it
sits with the compile driver. What a run would read it asks the runtime's own
readers (token files, weight files, the mesh's size and backend), the one
crossing into the runtime the rooms allow (`tests/test_rooms.py`).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ptc.errors import Diagnostic, PtcError, Span, UnpricedError
from ptc.plan import Plan
from ptc.runtime.data import check_data
from ptc.runtime.hf_weights import SafetensorsState, check_hf_dir
from ptc.units import format_bytes

if TYPE_CHECKING:
    from torch import nn

    from ptc.compiler.records.estimate import Estimate


def preflight(plan: Plan, *, overrides: Collection[str] = (), allow_oom: bool = False,
              vocab: int | None = None, factory: bool = True, module_priced: bool = False,
              compiler: Callable[[Plan], object] | None = None,
              sent_bytes: int = 0) -> list[Diagnostic]:
    """Every problem the run would meet that can be seen now (the module docstring).

    `overrides`: the "section.key" fields set on the command line, named by flag;
    `vocab`: the vocabulary token ids must stay below (default: the plan's model);
    `factory`: whether the workers build the model from its factory (not when they are
    sent the user's module); `module_priced`: the module they are sent is the model the
    plan prices (its compile found it so), so its memory is checked too; `compiler`: what
    the workers will compile the plan with
    (`compile_plan`): a custom model is compiled here first, so a structure the passes
    cannot split is refused before any process starts; `sent_bytes`: the bytes of the
    module each worker is sent (its weights), which every rank of a host holds at once.
    """
    where = _Where(plan, overrides)
    found = _files_and_folders(plan, where, vocab)
    if found:
        return found  # answered before torch is imported: a second, not five
    try:
        check_init(plan, factory=factory)
    except PtcError as exc:
        found.append(where.error("train", "init", str(exc)))
    custom = plan.model.family == "custom"
    factory_problem = _factory_problem(plan.model.factory) if custom and factory else None
    if sent_bytes:
        found += _host_memory(plan, where, allow_oom, sent_bytes, sent=True)
    elif custom and factory and not factory_problem:
        found += _host_memory(plan, where, allow_oom, cpu_build_bytes(plan), sent=False)
    problem = _fp8_problem(plan) or _fp16_problem(plan)
    if problem:
        found.append(where.error("train", "dtype", problem))
    problem = _device_problem(plan)
    if problem:
        found.append(where.error("hardware", "gpu", problem, "warning"))
    if custom:
        if factory_problem:
            found.append(where.error("model", "factory", factory_problem))
        elif factory and plan.is_resolved:
            found += _custom_model(plan, where, allow_oom, compiler)
        elif module_priced and plan.is_resolved:
            found += _memory(plan, where, allow_oom)
    elif plan.is_resolved:
        try:
            found += _memory(plan, where, allow_oom)
        except UnpricedError:  # no prediction: the run says so in its opening line
            pass
    return found


def _files_and_folders(plan: Plan, where: _Where, vocab: int | None) -> list[Diagnostic]:
    """The checks that need only the file system and numpy: data, weights' presence, folders,
    the wandb package."""
    found = []
    try:
        check_data(plan.train.data, vocab=vocab or plan.model.vocab, seq_len=plan.train.seq_len)
    except PtcError as exc:
        found.append(where.error("train", "data", str(exc)))
    init = plan.train.init
    try:
        if init.kind == "hf":
            check_hf_dir(init.path)
        elif init.kind == "state_dict" and not Path(init.path).is_file():
            raise PtcError(f"state_dict(\"{init.path}\"): no such file")
    except PtcError as exc:
        found.append(where.error("train", "init", str(exc)))
    runtime = plan.runtime
    for name, folder in (("checkpoint_dir", runtime.checkpoint_dir),
                         ("tensorboard", runtime.tensorboard),
                         ("metrics", Path(runtime.metrics).parent if runtime.metrics else None)):
        problem = _unwritable(folder) if folder is not None else None
        if name == "metrics" and problem is None and runtime.metrics and \
                Path(runtime.metrics).is_dir():
            problem = f"{runtime.metrics} is a directory; metrics names a file"
        if problem:
            found.append(where.error("runtime", name, problem))
    if runtime.wandb and importlib.util.find_spec("wandb") is None:
        found.append(where.error("runtime", "wandb", f"runtime.wandb = \"{runtime.wandb}\" needs "
                                 f"the wandb package; pip install wandb, or remove the field"))
    return found


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
        import torch  # noqa: PLC0415 - after the file checks, which answer without it

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
    from ptc.models import build_model  # noqa: PLC0415 - imports torch

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
    weights (`ptc.runtime.init.reference_model`): a custom factory's with init = random,
    whose values are its own init under the seed; 0 otherwise (a built-in family's values
    are made parameter by parameter, a file's read in parts). Measured on the factory's
    model built on meta."""
    if plan.model.family != "custom" or plan.train.init.kind != "random":
        return 0
    from ptc.models import build_model  # noqa: PLC0415 - imports torch
    from ptc.runtime.init import tensor_bytes  # noqa: PLC0415

    try:
        model = build_model(plan.model, device="meta")
    except Exception:  # noqa: BLE001 - a factory that fails: the factory check says why
        return 0
    return tensor_bytes(model)


def memory_problems(plan: Plan, est: Estimate, *, overrides: Collection[str] = ()
                    ) -> list[Diagnostic]:
    """The memory check alone (`ptc explain`), of the estimate `est` it has already made: a
    diagnostic per stage over the budget."""
    if plan.model.family == "custom" or not plan.is_resolved:
        return []
    return _memory(plan, _Where(plan, overrides), allow_oom=False, est=est)


class _Where:
    """The place to report a field at: its span in the file, or its command-line flag."""

    def __init__(self, plan: Plan, overrides: Collection[str]):
        self.plan, self.overrides = plan, set(overrides)

    def error(self, section: str, key: str, message: str, severity: str = "error",
              label: str | None = None) -> Diagnostic:
        """A diagnostic at `section.key` (`label`: the field to name, default that one)."""
        field = f"{section}.{key}"
        message = message.removeprefix(f"{field}: ")
        if field in self.overrides:
            return Diagnostic(message=message, field=f"--{field}", severity=severity)
        spans = getattr(getattr(self.plan, section), "spans", {})
        span: Span | None = spans.get(key) if key in spans else next(iter(spans.values()), None)
        return Diagnostic(message=message, field=label or field, span=span, severity=severity)


def _unwritable(folder: str | Path) -> str | None:
    """Why `folder` cannot be used to write into, or None; asks the nearest existing folder."""
    path = Path(folder)
    if path.exists():
        if not path.is_dir():
            return f"{path} exists and is not a directory"
        return None if os.access(path, os.W_OK | os.X_OK) else f"{path} is not writable"
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{path} cannot be created: {parent} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{path} cannot be created: {parent} is not writable"
    return None


def _fp8_problem(plan: Plan) -> str | None:
    """Why the run's devices cannot run train.dtype = fp8's float8 GEMMs, or None."""
    if plan.train.dtype != "fp8" or plan.train.fp8_emulate:
        return None
    from ptc.ops.fp8_linear import device_has_fp8, no_fp8_reason  # noqa: PLC0415 - torch
    from ptc.runtime.mesh import backend_for  # noqa: PLC0415

    recipe = plan.train.fp8_recipe
    if backend_for(plan) == "nccl" and device_has_fp8("cuda:0", recipe):
        return None
    if recipe == "mxfp8":
        return no_fp8_reason("", recipe)
    what = "" if recipe == "tensorwise" else f" with fp8_recipe = {recipe}"
    need = "float8 matmuls (compute capability 8.9+)" if recipe == "tensorwise" else \
        f"{recipe}-scaled float8 matmuls (compute capability 9.0+)"
    return (f"train.dtype = fp8{what} needs a GPU with {need}; this machine has none; "
            "set train.fp8_emulate = true to emulate")


def _device_problem(plan: Plan) -> str | None:
    """A plan for GPUs whose backend is left to ptc (auto) on a machine without CUDA: its
    ranks would train on the CPU, far slower than the GPUs it was priced for (a container
    started without its GPUs trains all the same); said, not refused."""
    import torch  # noqa: PLC0415

    if plan.hardware.synchronous or plan.runtime.backend != "auto" or torch.cuda.is_available():
        return None
    return (f"hardware.gpu = {plan.hardware.gpu}, but this machine has no CUDA device: the "
            f"ranks will train on its CPU (gloo), and the predictions are for "
            f"{plan.hardware.gpu}; set runtime.backend = gloo where that is meant")


def _fp16_problem(plan: Plan) -> str | None:
    """Why train.dtype = fp16 cannot be trained, or None (the module docstring)."""
    if plan.train.dtype != "fp16":
        return None
    return ("train.dtype = fp16 needs loss scaling, which ptc's runtime does not do: "
            "gradients below fp16's smallest number would train as zeros; use bf16 or fp32")


def _factory_problem(factory: str) -> str | None:
    """Why a custom model's "package.module:function" cannot be found, or None."""
    from ptc.models.build import resolve_factory  # noqa: PLC0415 - imports torch

    try:
        resolve_factory(factory)
    except PtcError as exc:
        return f"{exc}; run from the folder that holds it, or put it on PYTHONPATH"
    return None


def _host_memory(plan: Plan, where: _Where, allow_oom: bool, per_rank: int, *,
                 sent: bool) -> list[Diagnostic]:
    """An error at train.init when the ranks of one host, each holding a whole model of
    `per_rank` bytes on the CPU (`sent`: the module ptc.run sends them; else the factory's
    model built to take its own init), need more than this machine has available."""
    from ptc.runtime.mesh import world_size  # noqa: PLC0415 - imports torch

    ranks = max(1, world_size(plan) // plan.hardware.nodes)
    available = _host_available_bytes()
    if not per_rank or available is None or ranks * per_rank <= available:
        return []
    why = ("receives the module given to ptc.compile, its weights whole" if sent else
           "builds the custom model whole to take its part of the factory's own init")
    fix = ("save its weights (torch.save(module.state_dict(), path)) and compile it built "
           "on the meta device with init = state_dict(path)" if sent else
           "give the weights as a file (init = state_dict(path) or hf(dir))")
    going = "going on (--allow-oom)" if allow_oom else "--allow-oom runs it anyway"
    return [where.error("train", "init", (
        f"each of the {ranks} ranks of a host {why} on the CPU ({format_bytes(per_rank)}): "
        f"{format_bytes(ranks * per_rank)}, more than the {format_bytes(available)} this "
        f"machine has available; {fix}, of which each rank reads only its part; {going}"),
        "warning" if allow_oom else "error")]


def _host_available_bytes() -> int | None:
    """Memory this machine can still give (Linux's MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _custom_model(plan: Plan, where: _Where, allow_oom: bool,
                  compiler: Callable[[Plan], object] | None) -> list[Diagnostic]:
    """A custom model's capture, compile and memory problems: the factory's model is
    captured and profiled here (the workers read the kept profile) and, given the
    `compiler`, compiled, so a model ptc cannot train under the plan's layout is refused
    before any process starts; one ptc can train but not price is not memory-checked."""
    from ptc.errors import CaptureError, CompileError  # noqa: PLC0415

    try:
        found = _memory(plan, where, allow_oom)
    except CaptureError as exc:
        return [where.error("model", "factory", str(exc))]
    except (PtcError, ValueError):  # no profile: the run says so in its opening line
        found = []
    if compiler is None:
        return found
    try:
        compiler(plan)
    except CaptureError as exc:
        return [*found, where.error("model", "factory", str(exc))]
    except CompileError as exc:  # at the plan field that asked for the failing pass
        section, key = (exc.field or "model.factory").split(".", 1)
        return [*found, where.error(section, key, str(exc))]
    return found


def _memory(plan: Plan, where: _Where, allow_oom: bool, est: Estimate | None = None
            ) -> list[Diagnostic]:
    """One diagnostic per pipeline stage whose predicted peak exceeds the budget (of `est`,
    else of the plan's estimate)."""
    from ptc.compiler.search.estimate import estimate  # noqa: PLC0415 - sympy, and torch to profile
    from ptc.compiler.search.fit import (  # noqa: PLC0415
        largest_micro_batch, smallest_model_parallel)
    from ptc.compiler.profile.cache import with_model_shape  # noqa: PLC0415

    plan = with_model_shape(plan)  # a custom model's shape, which the hints below read
    est = estimate(plan) if est is None else est
    if est.fits:
        return []
    over = [(stage, peak) for stage, peak in enumerate(est.stage_memory_bytes)
            if peak > est.budget_bytes]
    hints = []
    micro_batch = largest_micro_batch(plan)
    if micro_batch:
        hints.append(f"micro_batch = {micro_batch}")
    model_parallel = smallest_model_parallel(plan)
    if model_parallel:
        hints.append(f"tp = {model_parallel[0]}, pp = {model_parallel[1]}")
    would = f"it would fit with {' or '.join(hints)}; " if hints else ""
    severity = "warning" if allow_oom else "error"
    going = "going on (--allow-oom)" if allow_oom else "--allow-oom runs it anyway"
    return [where.error(
        "parallel", "tp",
        f"stage {stage} needs {format_bytes(peak)} per GPU, {format_bytes(peak - est.budget_bytes)}"
        f" over the {format_bytes(est.budget_bytes)} budget (HBM less memory_margin); {would}"
        f"`ptc plan` ranks the layouts that fit; {going}", severity, label="parallel")
        for stage, peak in over]
