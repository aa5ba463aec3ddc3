"""Write a `Plan` as canonical plan text, so that `parse(dump_plan(p)) == p`.

*Canonical* means one fixed layout: sections in the order model, hardware,
parallel, train, runtime, moe; keys in schema order; two-space indent; a field
is written when it differs from its default (the mesh degrees, the batch
shape and the dtype are always written, since a reader looks for them).
With a preset gpu only the figures that differ from the preset are
written. Quantities get the unit that writes them shortest and still reads
back to the identical float. Fields that the chosen form ignores (SGD's
betas, the seed of token-file data) are not written.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from typing import Any

from ptc.dsl.schema import (HARDWARE_KEYS, MODEL_KEYS, MOE_KEYS, PARALLEL_KEYS, RUNTIME_KEYS,
                            TRAIN_KEYS)
from ptc.errors import PtcError
from ptc.plan import (
    DataSpec,
    HardwareSpec,
    InitSpec,
    LRScheduleSpec,
    ModelSpec,
    OptimizerSpec,
    ParallelSpec,
    Plan,
    MoESpec,
    RuntimeSpec,
    TrainSpec,
    is_auto_checkpoint,
    policy_modules,
    profile_fields,
)
from ptc.units import UNITS

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+[A-Za-z_][A-Za-z0-9_]*")
_NUMBER_LIKE = re.compile(r"\d+[eE]\d+")  # lexes as a float, so it cannot be a bare name
_KEYWORDS = {"true", "false", "none"}

# Fields whose string values are choices, written bare (`dtype = bf16`,
# `tp = auto`) rather than quoted like paths.
_WORD_FIELDS = {"norm", "activation", "dtype", "backend", "nan_policy", "tp", "pp", "dp", "cp",
                "ep", "drop_policy", "bucket_size", "offload", "checkpoint_every",
                "snapshot_every"}

# Which dimension each quantity field measures, keyed by plan field name.
_QUANTITY_FIELDS = {"hbm_bytes": "bytes", "mem_bandwidth": "bandwidth",
                    "checkpoint_interval": "time", "mtbf": "time", "hang_timeout": "time", "memory_margin": "bytes",
                    "bucket_size": "bytes", "host_bandwidth": "bandwidth",
                    "host_memory_bytes": "bytes", "dispatch_overhead": "time",
                    "board_power": "power", "min_power_limit": "power", "power_limit": "power"}


def dump_plan(plan: Plan) -> str:
    """The canonical plan text of `plan`; `parse` of it gives an equal `Plan`.

    Raises `PtcError` for a value the language cannot write (a custom model
    argument that is a dict, a non-finite number).
    """
    parts = [_model(plan.model), _hardware(plan.hardware), _parallel(plan.parallel),
             _train(plan.train), _runtime(plan.runtime), _moe(plan.moe)]
    return "\n".join(p for p in parts if p)


# ----------------------------------------------------------------- sections


def _section(header: str, lines: Iterable[str]) -> str:
    body = "".join(f"  {line}\n" for line in lines)
    return f"{header} {{\n{body}}}\n"


def _default(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _keys_by_field(table: dict) -> dict[str, str]:
    return {key.field: name for name, key in table.items()}


def _scalar_lines(obj: Any, table: dict, always: tuple[str, ...] = (),
                  skip: tuple[str, ...] = ()) -> list[str]:
    """`key = value` for the fields of `table` that differ from their defaults."""
    lines = []
    for key, spec in table.items():
        if spec.field in skip:
            continue
        value = getattr(obj, spec.field)
        if spec.field not in always and value == _default(type(obj), spec.field):
            continue
        lines.append(f"{key} = {_value_of(spec.field, value)}")
    return lines


def _value_of(field: str, value: Any) -> str:
    if field in _QUANTITY_FIELDS and value not in (None, "auto"):
        return quantity(value, _QUANTITY_FIELDS[field])
    if field in _WORD_FIELDS and isinstance(value, str):
        return word(value)
    return literal(value)


def _model(model: ModelSpec) -> str:
    if model.family == "custom":
        lines = [f"{_key(k)} = {literal(v)}" for k, v in dict(model.kwargs).items()]
        return _section(f"model {quote(model.factory or '')}", lines)
    always = tuple(k.field for k in MODEL_KEYS.values() if k.required)
    return _section(f"model {model.family}", _scalar_lines(model, MODEL_KEYS, always))


def _hardware(hw: HardwareSpec) -> str:
    lines = [f"gpu = {word(hw.gpu)}", f"nodes = {literal(hw.nodes)}",
             f"gpus_per_node = {literal(hw.gpus_per_node)}"]
    keys = _keys_by_field(HARDWARE_KEYS)
    # Figures a profile gives are written as the profile, not one by one.
    profiled = profile_fields(hw.profile) if hw.profile else {}
    if hw.profile:
        lines.append(f"profile = {quote(hw.profile)}")
    reference = None if hw.gpu == "custom" else HardwareSpec.preset(hw.gpu, profile=hw.profile)
    for name in ("hbm_bytes", "peak_flops", "mem_bandwidth", "intra", "inter",
                 "nvlink_sharp", "achievable_fraction", "attention_fraction", "memory_margin",
                 "host_bandwidth",
                 "host_memory_bytes", "gemm_flops", "dispatch_overhead", "multiprocessors",
                 "comm_multiprocessors", "board_power", "min_power_limit", "power_limit"):
        value = getattr(hw, name)
        base = getattr(reference, name) if reference else profiled.get(
            name, _default(HardwareSpec, name))
        if value == base:
            continue
        if name in ("peak_flops", "gemm_flops"):
            text = "flops(" + ", ".join(f"{_key(d)} = {quantity(v, 'flops')}"
                                        for d, v in dict(value).items()) + ")"
        elif name in ("intra", "inter"):
            text = (f"link(bandwidth = {quantity(value.bandwidth, 'bandwidth')}, "
                    f"latency = {quantity(value.latency, 'time')})")
        else:
            text = _value_of(name, value)
        lines.append(f"{keys[name]} = {text}")
    return _section("hardware", lines)


def _parallel(par: ParallelSpec) -> str:
    lines = _scalar_lines(par, PARALLEL_KEYS, always=("tp", "pp", "dp", "zero"),
                          skip=("schedule", "virtual_stages", "checkpoint", "order",
                                "stage_boundaries"))
    if par.schedule == "interleaved" or (par.schedule == "zero_bubble"
                                          and par.virtual_stages != 1):
        lines.append(f"schedule = {par.schedule}(virtual_stages = "
                     f"{literal(par.virtual_stages)})")
    else:
        lines.append(f"schedule = {word(par.schedule)}")
        if par.virtual_stages != 1 and not par.v_shaped:  # a V is two chunks
            lines.append(f"virtual_stages = {literal(par.virtual_stages)}")
    if par.checkpoint != "none":
        lines.append(f"checkpoint = {checkpoint(par.checkpoint)}")
    if par.order != _default(ParallelSpec, "order"):
        lines.append("order = (" + ", ".join(word(a) for a in par.order) + ")")
    if par.stage_boundaries:
        lines.append("stage_boundaries = [" + ", ".join(
            "none" if b is None else quote(b) for b in par.stage_boundaries) + "]")
    lines += [f"shard {quote(rule.pattern)} {word(rule.style)}" for rule in par.shards]
    return _section("parallel", lines)


def _train(train: TrainSpec) -> str:
    lines = _scalar_lines(train, TRAIN_KEYS,
                          always=("seq_len", "global_batch", "micro_batch", "dtype", "steps"),
                          skip=("optimizer", "lr_schedule", "data", "init"))
    lines.append(f"optimizer = {_optimizer(train.optimizer)}")
    if train.lr_schedule != LRScheduleSpec():
        lines.append(f"lr_schedule = {_lr_schedule(train.lr_schedule)}")
    if train.data != DataSpec():
        lines.append(f"data = {_data(train.data)}")
    if train.init != InitSpec():
        lines.append(f"init = {_init(train.init)}")
    return _section("train", lines)


def _runtime(runtime: RuntimeSpec) -> str:
    lines = _scalar_lines(runtime, RUNTIME_KEYS)
    return _section("runtime", lines) if lines else ""


def _moe(moe: MoESpec) -> str:
    lines = _scalar_lines(moe, MOE_KEYS)
    return _section("moe", lines) if lines else ""


# ------------------------------------------------------------------- calls


def _call(name: str, args: Iterable[str]) -> str:
    args = list(args)
    return f"{word(name)}({', '.join(args)})" if args else word(name)


def _optimizer(opt: OptimizerSpec) -> str:
    params = ("lr", "betas", "eps", "weight_decay") if opt.name == "adamw" \
        else ("lr", "momentum", "weight_decay")
    return f"{word(opt.name)}(" + ", ".join(f"{p} = {_num_or_tuple(getattr(opt, p))}"
                                            for p in params) + ")"


def _num_or_tuple(value: Any) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(number(v) for v in value) + ")"
    return number(value)


def _lr_schedule(lr: LRScheduleSpec) -> str:
    args = []
    if lr.warmup:
        args.append(f"warmup = {literal(lr.warmup)}")
    if lr.kind != "constant":
        args.append(f"min_lr = {number(lr.min_lr)}")
        if lr.decay_steps is not None:
            args.append(f"decay_steps = {literal(lr.decay_steps)}")
    return _call(lr.kind, args)


def _data(data: DataSpec) -> str:
    if data.kind == "tokens":
        return _call("tokens", [quote(data.path or ""), f"dtype = {word(data.dtype)}"])
    return _call(data.kind, [f"seed = {literal(data.seed)}"])


def _init(init: InitSpec) -> str:
    if init.kind in ("state_dict", "hf"):
        return _call(init.kind, [quote(init.path or "")])
    return _call(init.kind, [f"seed = {literal(init.seed)}"])


def checkpoint(policy: str | tuple[str, ...]) -> str:
    """A checkpoint policy; a per-layer tuple as `layers(full = 0..39, ...)`."""
    if isinstance(policy, str):
        return policy if policy_modules(policy) or is_auto_checkpoint(policy) else word(policy)
    runs: dict[str, list[str]] = {}
    start = 0
    for i in range(1, len(policy) + 1):
        if i == len(policy) or policy[i] != policy[start]:
            runs.setdefault(policy[start], []).append(
                str(start) if i - 1 == start else f"{start}..{i - 1}")
            start = i
    parts = [f"{p if policy_modules(p) else _key(p)} = "
             f"{r[0] if len(r) == 1 else '[' + ', '.join(r) + ']'}"
             for p, r in runs.items()]
    return f"layers({', '.join(parts)})"


# ------------------------------------------------------------------ values


def literal(value: Any) -> str:
    """Plan text for a plain Python value (bool, None, int, float, str, tuple, list)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        if abs(value) >= 2**63:
            raise PtcError(f"cannot write the integer {value}: plan integers are below 2**63")
        return str(value)
    if isinstance(value, float):
        return number(value)
    if isinstance(value, str):
        return quote(value)
    if isinstance(value, tuple):
        items = [literal(v) for v in value]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(value, list):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    raise PtcError(f"cannot write {type(value).__name__} value {value!r} in a plan file")


def number(value: float) -> str:
    """A float (or int) as a literal that reads back to the same float."""
    value = float(value)
    if not math.isfinite(value):
        raise PtcError(f"cannot write the non-finite number {value!r} in a plan file")
    return repr(value)


def quantity(value: float, dimension: str) -> str:
    """`value` (in base units) with the unit of `dimension` that writes it shortest
    and reads back exactly, e.g. `80 GiB`, `450 GB/s`, `2 us`, `30 min`."""
    value = float(value)
    if not math.isfinite(value):
        raise PtcError(f"cannot write the non-finite quantity {value!r} in a plan file")
    best: tuple | None = None
    for unit, (dim, scale) in UNITS.items():
        if dim != dimension:
            continue
        q = value / scale
        if not math.isfinite(q):
            continue
        text = str(int(q)) if q.is_integer() and abs(q) < 2**53 else repr(q)
        read_back = (int(text) if q.is_integer() and abs(q) < 2**53 else float(text)) * scale
        if read_back != value:
            continue
        # As an engineer writes it: a value in [1, 1000) (30 min, not 1800 s),
        # whole if possible (450 GB/s, not 3.6 Tb/s), short, bytes over bits.
        candidate = (_off_range(q, scale), not q.is_integer(), len(text), "b/" in unit,
                     -scale, f"{text} {unit}")
        if best is None or candidate[:5] < best[:5]:
            best = candidate
    if best is None:  # unreachable: the base unit (scale 1) always reads back
        raise PtcError(f"cannot write the quantity {value!r} ({dimension})")
    return best[5]


def _off_range(q: float, scale: float) -> float:
    """How many decades `q` lies outside [1, 1000); zero belongs to the base unit."""
    if q == 0:
        return 0.0 if scale == 1.0 else 1.0
    decade = math.log10(abs(q))
    return max(0.0, -decade, decade - 3 + 1e-12) if not 1 <= abs(q) < 1000 else 0.0


def word(text: str) -> str:
    """A choice as a bare name when the lexer reads it as one, else quoted."""
    if _NAME.fullmatch(text) and not _NUMBER_LIKE.fullmatch(text) and text not in _KEYWORDS:
        return text
    return quote(text)


def _key(text: str) -> str:
    if not _NAME.fullmatch(text) or _NUMBER_LIKE.fullmatch(text):
        raise PtcError(f"cannot write {text!r} as a key in a plan file")
    return text


def quote(text: str) -> str:
    """A string literal: backslash, quote and control characters escaped."""
    out = ['"']
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif not ch.isprintable() or 0xD800 <= ord(ch) <= 0xDFFF:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)
