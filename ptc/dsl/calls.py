"""Values written as calls: `adamw(lr = 3e-4)`, `link(...)`, `layers(full = 0..39)`.

A call names one *form* of a value (the optimizer adamw, the schedule
interleaved) and gives its parameters. `read_call` checks the form name and
the arguments against a table of forms; the converters below turn a call
into the plan dataclass it stands for. A bare name is a call without
arguments (`lr_schedule = constant`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ptc.dsl import ast
from ptc.dsl.construct import construct
from ptc.dsl.values import (
    INVALID,
    Converter,
    Reader,
    integer,
    number,
    number_pair,
    optional,
    quantity,
    show,
    string,
    word,
)
from ptc.errors import Span, did_you_mean
from ptc.plan import (
    AUTO_CHOICES,
    CHECKPOINT_POLICIES,
    DTYPES,
    LAYER_CHECKPOINT_POLICIES,
    RECOMPUTE_MODULES,
    SCHEDULES,
    TOKEN_DTYPES,
    DataSpec,
    InitSpec,
    LinkSpec,
    LRScheduleSpec,
    OptimizerSpec,
    modules_policy,
)

MAX_PER_LAYER = 100_000
"""Most layers a per-layer checkpoint policy may list (bounds memory on bad input)."""

COMPUTE_DTYPES = DTYPES + ("tf32", "fp8")


@dataclass(frozen=True, slots=True)
class Form:
    """One form of a call value: its parameters and how to read each."""

    params: dict[str, Converter] = field(default_factory=dict)
    """Parameter name (= plan field name) -> converter."""
    positional: tuple[str, ...] = ()
    """Parameters that may also be given by position, in order."""
    required: tuple[str, ...] = ()
    """Parameters that must be given."""
    example: str = ""
    """A complete example, for messages."""


@dataclass(slots=True)
class CallRead:
    """What `read_call` found: the form, the good arguments, their spans."""

    name: str
    values: dict[str, Any]
    spans: dict[str, Span]
    ok: bool


def read_call(r: Reader, node: ast.Value, key: str, forms: dict[str, Form],
              what: str) -> CallRead | Any:
    """Check a call (or bare name) against `forms`; INVALID if its name is unusable.

    `what` names the kind of value in messages ("optimizer"). Bad arguments
    are reported and left out, with `ok` False.
    """
    if isinstance(node, ast.Invalid):
        return INVALID
    choices = tuple(forms)
    if isinstance(node, ast.Name):
        name, name_pos, args, kwargs = node.name, node.pos, (), ()
    elif isinstance(node, ast.Call):
        name, name_pos, args, kwargs = node.name, node.name_pos, node.args, node.kwargs
    else:
        listed = ", ".join(forms[n].example or n for n in forms)
        return r.error(f"{key} must be one of {listed}, got {show(node)}", node.pos, key,
                       choices)
    if name not in forms:
        return r.error(f"unknown {what} '{name}'{did_you_mean(name, choices)}", name_pos,
                       key, choices)
    form = forms[name]
    sub = r.at(f"{r.path}.{key}")
    result = CallRead(name=name, values={}, spans={what: r.source.span(name_pos)}, ok=True)
    given: dict[str, ast.Pos] = {}

    def take(param: str, value: ast.Value, pos: ast.Pos) -> None:
        if param in given:
            result.ok = False
            sub.error(f"{name}: {param} is given twice (first at column {given[param].column})",
                      pos, param)
            return
        given[param] = pos
        converted = form.params[param](sub, value, param)
        if converted is INVALID:
            result.ok = False
        else:
            result.values[param] = converted
            result.spans[param] = r.source.span(value.pos)

    for index, arg in enumerate(args):
        if index >= len(form.positional):
            result.ok = False
            if form.positional:
                message = (f"{name} takes {len(form.positional)} positional argument"
                           f"{'s' if len(form.positional) > 1 else ''} "
                           f"({', '.join(form.positional)}); name the others")
            else:
                message = f"{name} takes named arguments only, e.g. {form.example or name + '()'}"
            sub.error(message, arg.pos)
            continue
        take(form.positional[index], arg, arg.pos)
    for kwarg in kwargs:
        if kwarg.key_call is not None:
            result.ok = False
            sub.error(f"{name} takes name = value arguments, not {show(kwarg.key_call)} = ...",
                      kwarg.key_pos)
            continue
        if kwarg.key not in form.params:
            result.ok = False
            valid = tuple(form.params)
            hint = did_you_mean(kwarg.key, valid) if valid else "; it takes no arguments"
            sub.error(f"unknown argument '{kwarg.key}' of {name}{hint}", kwarg.key_pos,
                      kwarg.key, valid)
            continue
        take(kwarg.key, kwarg.value, kwarg.key_pos)
    for param in form.required:
        if param not in given:
            result.ok = False
            sub.error(f"{name} needs {param}, e.g. {form.example}", name_pos, param)
    return result


def call_converter(make: Any, kind_field: str, forms: dict[str, Form], what: str) -> Converter:
    """A converter from a call to the dataclass `make(kind_field=name, **args)`."""

    def convert(r: Reader, node: ast.Value, key: str) -> Any:
        read = read_call(r, node, key, forms, what)
        if read is INVALID:
            return INVALID
        spans = dict(read.spans)
        spans[kind_field] = spans.pop(what)
        # Arguments already reported as wrong or missing are left to the
        # dataclass default; its complaints about them would be repeats.
        skipped = set(forms[read.name].params) - set(read.values)
        built = construct(make, {kind_field: read.name, **read.values, "spans": spans},
                          r.source, placeholders=skipped if not read.ok else ())
        return built if read.ok else INVALID

    return convert


# ------------------------------------------------------------------ train

_LR_PARAMS = {"warmup": integer, "min_lr": number, "decay_steps": optional(integer)}

optimizer = call_converter(OptimizerSpec, "name", {
    "adamw": Form({"lr": number, "betas": number_pair, "eps": number, "weight_decay": number},
                  example="adamw(lr = 3e-4, betas = (0.9, 0.95), weight_decay = 0.1)"),
    "sgd": Form({"lr": number, "momentum": number, "weight_decay": number},
                example="sgd(lr = 0.1, momentum = 0.9)"),
}, "optimizer")
"""optimizer = adamw(...) | sgd(...)."""

lr_schedule = call_converter(LRScheduleSpec, "kind", {
    "constant": Form({"warmup": integer}, example="constant(warmup = 100)"),
    "cosine": Form(_LR_PARAMS, example="cosine(warmup = 100, min_lr = 3e-5)"),
    "linear": Form(_LR_PARAMS, example="linear(warmup = 100, min_lr = 0.0)"),
}, "lr_schedule")
"""lr_schedule = constant | cosine(...) | linear(...)."""

data = call_converter(DataSpec, "kind", {
    "synthetic": Form({"seed": integer}, example="synthetic(seed = 0)"),
    "uniform": Form({"seed": integer}, example="uniform(seed = 0)"),
    "tokens": Form({"path": string, "dtype": word(TOKEN_DTYPES)}, positional=("path",),
                   required=("path",), example='tokens("train.bin", dtype = uint16)'),
}, "data")
"""data = synthetic(seed = N) | uniform(seed = N) | tokens("path", dtype = uint16|uint32)."""

init = call_converter(InitSpec, "kind", {
    "random": Form({"seed": integer}, example="random(seed = 0)"),
    "state_dict": Form({"path": string}, positional=("path",), required=("path",),
                       example='state_dict("weights.pt")'),
    "hf": Form({"path": string}, positional=("path",), required=("path",),
               example='hf("llama-1b")'),
}, "init")
"""init = random(seed = N) | state_dict("path") | hf("save_pretrained directory")."""


# --------------------------------------------------------------- hardware

_LINK_FORMS = {"link": Form({"bandwidth": quantity("bandwidth"), "latency": quantity("time")},
                            required=("bandwidth", "latency"),
                            example="link(bandwidth = 450 GB/s, latency = 2 us)")}


def link(r: Reader, node: ast.Value, key: str) -> Any:
    """intra/inter = link(bandwidth = 450 GB/s, latency = 2 us) -> LinkSpec."""
    read = read_call(r, node, key, _LINK_FORMS, "link")
    if read is INVALID or not read.ok:
        return INVALID
    spans = {k: v for k, v in read.spans.items() if k != "link"}
    return construct(LinkSpec, {**read.values, "spans": spans}, r.source)


def flops(r: Reader, node: ast.Value, key: str) -> Any:
    """peak = flops(bf16 = 989 TFLOP/s, fp32 = 67 TFLOP/s) -> {dtype: FLOP/s}."""
    if isinstance(node, ast.Invalid):
        return INVALID
    if not isinstance(node, ast.Call) or node.name != "flops" or node.args:
        return r.error(f"{key} must be flops(dtype = peak, ...), e.g. "
                       f"{key} = flops(bf16 = 989 TFLOP/s, fp32 = 67 TFLOP/s), got {show(node)}",
                       node.pos, key)
    table: dict[str, float] = {}
    ok = True
    convert = quantity("flops")
    for kwarg in node.kwargs:
        if kwarg.key not in COMPUTE_DTYPES or kwarg.key_call is not None:
            ok = False
            r.error(f"unknown compute dtype '{kwarg.key}' in flops"
                    f"{did_you_mean(kwarg.key, COMPUTE_DTYPES)}", kwarg.key_pos, key,
                    COMPUTE_DTYPES)
            continue
        if kwarg.key in table:
            ok = False
            r.error(f"{kwarg.key} is given twice in flops", kwarg.key_pos, key)
            continue
        value = convert(r, kwarg.value, f"{key}.{kwarg.key}")
        if value is INVALID:
            ok = False
        else:
            table[kwarg.key] = value
    if not node.kwargs:
        return r.error(f"{key} = flops() needs at least one dtype, e.g. bf16 = 989 TFLOP/s",
                       node.pos, key)
    return table if ok else INVALID


# --------------------------------------------------------------- parallel

_SCHEDULE_FORMS = {
    "gpipe": Form(example="gpipe"),
    "1f1b": Form(example="1f1b"),
    "interleaved": Form({"virtual_stages": integer}, example="interleaved(virtual_stages = 2)"),
    "zero_bubble": Form({"virtual_stages": integer},
                        example="zero_bubble or zero_bubble(virtual_stages = 2)"),
    "zbv": Form(example="zbv"),
    "dualpipev": Form(example="dualpipev"),
}
assert tuple(_SCHEDULE_FORMS) == SCHEDULES


def schedule(r: Reader, node: ast.Value, key: str) -> Any:
    """schedule = gpipe | 1f1b | interleaved(virtual_stages = 2) | zero_bubble
    | zero_bubble(virtual_stages = 2) | zbv | dualpipev -> (name, vstages, span)."""
    read = read_call(r, node, key, _SCHEDULE_FORMS, "schedule")
    if read is INVALID or not read.ok:
        return INVALID
    return read.name, read.values.get("virtual_stages"), read.spans.get("virtual_stages")


def checkpoint(layers: int | None) -> Any:
    """A converter for `checkpoint`, knowing the model's layer count (None: unknown).

    Forms: a policy name or `modules(core_attn, mlp)`; `auto(all)` (the
    compiler chooses among every policy); a list with one policy per layer; or
    `layers(full = 0..39, modules(mlp) = 40..79)`, which must give every layer
    exactly one policy and becomes the per-layer tuple.
    """
    policy = word(CHECKPOINT_POLICIES)
    per_layer = word(LAYER_CHECKPOINT_POLICIES)

    def layer_policy(r: Reader, node: ast.Value, key: str) -> Any:
        if isinstance(node, ast.Call) and node.name == "modules":
            return _modules(r, node, key)
        return per_layer(r, node, key)

    def convert(r: Reader, node: ast.Value, key: str) -> Any:
        if isinstance(node, ast.Name):
            return policy(r, node, key)
        if isinstance(node, ast.Call) and node.name == "modules":
            return _modules(r, node, key)
        if isinstance(node, ast.Call) and node.name == "auto":
            return _auto(r, node, key)
        if isinstance(node, ast.List):
            if len(node.items) > MAX_PER_LAYER:
                return r.error(f"{key} lists more than {MAX_PER_LAYER} layers", node.pos, key)
            values = [layer_policy(r, item, key) for item in node.items]
            if not values:
                return r.error(f"{key} = [] lists no layers", node.pos, key)
            return INVALID if any(v is INVALID for v in values) else tuple(values)
        if isinstance(node, ast.Call) and node.name == "layers":
            return _layer_ranges(r, node, key, layers)
        if isinstance(node, ast.Invalid):
            return INVALID
        return r.error(f"{key} must be a policy ({', '.join(CHECKPOINT_POLICIES)}), "
                       f"modules(core_attn, mlp, ...), auto(all), a list with one policy per "
                       f"layer, or "
                       f"layers(full = 0..39, ...), got {show(node)}", node.pos, key,
                       CHECKPOINT_POLICIES)

    return convert


def _auto(r: Reader, node: ast.Call, key: str) -> Any:
    """`auto(all)` -> "auto(all)": auto choosing among every policy (`plan.AUTO_CHOICES`)."""
    valid = tuple(f"auto({c})" for c in AUTO_CHOICES)
    for kwarg in node.kwargs:
        return r.error(f"auto(...) takes what to choose from, e.g. auto(all), not "
                       f"{kwarg.key} = ...", kwarg.key_pos, key, valid)
    if len(node.args) != 1:
        where = node.args[1].pos if len(node.args) > 1 else node.pos
        return r.error(f"auto(...) takes one argument, e.g. auto(all); got {len(node.args)}",
                       where, key, valid)
    arg = node.args[0]
    if isinstance(arg, ast.Invalid):
        return INVALID
    if not isinstance(arg, ast.Name) or arg.name not in AUTO_CHOICES:
        shown = arg.name if isinstance(arg, ast.Name) else show(arg)
        hint = did_you_mean(shown, AUTO_CHOICES) if isinstance(arg, ast.Name) else ""
        return r.error(f"auto({shown}) is not a choice of auto(...){hint}", arg.pos, key, valid)
    return f"auto({arg.name})"


def _modules(r: Reader, node: ast.Call, key: str) -> Any:
    """`modules(core_attn, mlp)` -> its canonical policy string (`plan.modules_policy`)."""
    ok, names = True, []
    for kwarg in node.kwargs:
        ok = False
        r.error(f"modules(...) takes module names, e.g. modules(core_attn, mlp), not "
                f"{kwarg.key} = ...", kwarg.key_pos, key, RECOMPUTE_MODULES)
    for arg in node.args:
        if isinstance(arg, ast.Invalid):
            ok = False
        elif not isinstance(arg, ast.Name) or arg.name not in RECOMPUTE_MODULES:
            ok = False
            shown = arg.name if isinstance(arg, ast.Name) else show(arg)
            hint = did_you_mean(shown, RECOMPUTE_MODULES) if isinstance(arg, ast.Name) else ""
            r.error(f"unknown module '{shown}' in modules(...){hint}", arg.pos, key,
                    RECOMPUTE_MODULES)
        elif arg.name in names:
            ok = False
            r.error(f"modules(...) names {arg.name} twice", arg.pos, key)
        else:
            names.append(arg.name)
    if ok and not names:
        return r.error("modules() names no module", node.pos, key, RECOMPUTE_MODULES)
    return modules_policy(names) if ok else INVALID


def _layer_ranges(r: Reader, node: ast.Call, key: str, layers: int | None) -> Any:
    if node.args:
        return r.error("layers(...) takes policy = ranges, e.g. layers(full = 0..39, "
                       "selective = 40..79)", node.args[0].pos, key)
    if layers is not None and layers > MAX_PER_LAYER:
        return r.error(f"per-layer checkpoint policies support at most {MAX_PER_LAYER} "
                       f"layers, the model has {layers}", node.pos, key)
    owner: dict[int, tuple[str, ast.Pos]] = {}
    ok = True
    limit = layers if layers is not None else MAX_PER_LAYER
    for kwarg in node.kwargs:
        policy = kwarg.key
        if kwarg.key_call is not None and kwarg.key_call.name == "modules":
            policy = _modules(r, kwarg.key_call, key)
            if policy is INVALID:
                ok = False
                continue
        elif kwarg.key not in LAYER_CHECKPOINT_POLICIES or kwarg.key_call is not None:
            ok = False
            r.error(f"unknown per-layer policy '{kwarg.key}'"
                    f"{did_you_mean(kwarg.key, LAYER_CHECKPOINT_POLICIES)}", kwarg.key_pos, key,
                    LAYER_CHECKPOINT_POLICIES)
            continue
        parts = kwarg.value.items if isinstance(kwarg.value, ast.List) else (kwarg.value,)
        for part in parts:
            span = _layer_span(r, part, key, limit, layers)
            if span is None:
                ok = False
                continue
            for layer in range(span[0], span[1] + 1):
                if layer in owner:
                    ok = False
                    first, pos = owner[layer]
                    r.error(f"layer {layer} is given two policies: {first} (column "
                            f"{pos.column}) and {policy}", part.pos, key)
                    break
                owner[layer] = (policy, part.pos)
    if not ok:
        return INVALID
    count = layers if layers is not None else (max(owner) + 1 if owner else 0)
    missing = [i for i in range(count) if i not in owner]
    if not owner:
        return r.error(f"{key} = layers() gives no layers a policy", node.pos, key)
    if missing:
        return r.error(f"layers without a checkpoint policy: {_ranges_text(missing)} "
                       f"(every layer 0..{count - 1} needs exactly one)", node.pos, key)
    return tuple(owner[i][0] for i in range(count))


def _layer_span(r: Reader, part: ast.Value, key: str, limit: int,
                layers: int | None) -> tuple[int, int] | None:
    if isinstance(part, ast.Int):
        lo = hi = part.value
    elif isinstance(part, ast.Range):
        lo, hi = part.start, part.stop
    else:
        if not isinstance(part, ast.Invalid):
            r.error(f"layers(...) takes ranges such as 0..39 or layer numbers, got "
                    f"{show(part)}", part.pos, key)
        return None
    if hi < lo:
        r.error(f"range {lo}..{hi} is empty (write the smaller layer first)", part.pos, key)
        return None
    if lo < 0 or hi >= limit:
        bound = (f"the model has {layers} layers, 0..{layers - 1}" if layers is not None
                 else f"at most {MAX_PER_LAYER} layers")
        r.error(f"layers {lo}..{hi} are out of range ({bound})", part.pos, key)
        return None
    return lo, hi


def _ranges_text(numbers: list[int]) -> str:
    runs: list[str] = []
    start = prev = numbers[0]
    for n in numbers[1:] + [None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        runs.append(f"{start}..{prev}" if prev > start else str(start))
        if n is not None:
            start = prev = n
    return ", ".join(runs)
