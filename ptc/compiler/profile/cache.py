"""Where profiles come from: the plan's model shape, a disk cache keyed by the shape and
the sources that compute it (one profiler per shape at a time, under a lock), and the
factory's source for a custom model."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import inspect
import logging
import os
from pathlib import Path

import torch
import torch.fx

from ptc.compiler.graph.tp_structure import matching_rule
from ptc.compiler.profile.capture import profile_one_layer
from ptc.compiler.profile.fit import profile_functions
from ptc.compiler.profile.models import model_source
from ptc.compiler.profile.store import Unreadable, read_profile, write_profile
from ptc.compiler.profile.types import ModelProfile, Unprofiled
from ptc.errors import CaptureError, PtcError, UnpricedError
from ptc.plan import ModelSpec, Plan, ShardRule

log = logging.getLogger("ptc.compiler.profile")


def _shape_key(spec: ModelSpec) -> tuple:
    if spec.family == "custom":  # the factory and its arguments make the shape
        return spec.family, spec.factory, repr(sorted(spec.kwargs.items())), spec.max_seq
    return tuple(getattr(spec, f.name) for f in dataclasses.fields(spec)
                 if f.name not in ("layers", "spans", "kwargs"))


def model_profile(spec: ModelSpec, dtype: str, shards: tuple[ShardRule, ...] = (),
                  fp8_recipe: str = "tensorwise") -> ModelProfile:
    """The profile of `spec` at compute `dtype` ("bf16", ...) with the plan's `shard` rules
    deciding how tensor parallelism splits the linears they match (`plan_profile`), and
    for dtype "fp8" its `train.fp8_recipe`; captured once per model shape, rules and recipe.

    Kept in memory for the process and on disk (see `cache_dir`) across
    processes, keyed by the shape and by the source of everything that
    shapes a profile, so editing a model or the capture invalidates it. A
    model that cannot be profiled is kept too, as the reason it gives, raised
    as UnpricedError (it compiles and runs without predictions): profiling
    captures it a dozen times, and every rank and every estimate would
    pay that again to learn the same. A model that cannot be captured
    raises its CaptureError (at the first capture), and nothing is kept.
    Shard rules that place layers unlike each other raise UnpricedError too.
    """
    recipe = fp8_recipe if dtype == "fp8" else "tensorwise"
    key = (_shape_key(spec), dtype) + ((_rules_key(shards),) if shards else ()) \
        + ((("fp8_recipe", recipe),) if recipe != "tensorwise" else ())
    if key not in _CACHE:
        _CACHE[key] = _load_or_capture(spec, dtype, shards, key, recipe)
    profile = _CACHE[key]
    if isinstance(profile, Unprofiled):
        raise UnpricedError(profile.reason)
    layers = profile.shape.layers if profile.shape is not None else spec.layers
    _check_rules_alike(profile.layer_paths, shards, layers)
    return dataclasses.replace(profile, layers=layers)


def _check_rules_alike(layer_paths: tuple[str, ...], shards: tuple[ShardRule, ...],
                       layers: int) -> None:
    """UnpricedError when `shards` place some module of one layer unlike the same module of
    another ("layers.0.mlp.*" replicate): the profile prices every layer as layer 0."""
    unlike = _rules_unlike(layer_paths, _rules_key(shards), layers) if shards else None
    if unlike:
        raise UnpricedError(f"the shard rules place layers unlike each other ({unlike}); "
                            "ptc's memory and cost models price every layer as its first, "
                            "so ptc cannot predict this plan's memory or step time; compile, "
                            "inspect and run work without predictions")


@functools.cache
def _rules_unlike(layer_paths: tuple[str, ...], rules: tuple[tuple[str, str], ...],
                  layers: int) -> str | None:
    """Two placements of one module of layer 0 in different layers under `rules` ((pattern,
    style) pairs), or None: asked for every estimate, answered once per plan shape."""
    shards = tuple(ShardRule(pattern=pattern, style=style) for pattern, style in rules)
    for template in layer_paths:
        placed: dict[str, str] = {}
        for index in range(layers):
            path = template.format(index)
            rule = matching_rule(path, shards)
            placed.setdefault(rule.style if rule else "as inferred", path)
        if len(placed) > 1:
            (first, a), (second, b_path) = list(placed.items())[:2]
            return f"{a} {first}, {b_path} {second}"
    return None


def plan_profile(plan: Plan) -> ModelProfile:
    """The profile the memory and cost models read for `plan`: its model at its compute
    dtype (and fp8 recipe), split as its shard rules say."""
    return model_profile(plan.model, plan.train.dtype, plan.parallel.shards,
                         plan.train.fp8_recipe)


def _rules_key(shards: tuple[ShardRule, ...]) -> tuple:
    return tuple((rule.pattern, rule.style) for rule in shards)


def with_model_shape(plan: Plan) -> Plan:
    """`plan` with its model section's shape numbers filled in (`resolved_model`): what the
    memory and cost models read. A built-in family's plan comes back as it is."""
    if plan.model.family != "custom" or plan.model.hidden is not None:
        return plan
    return dataclasses.replace(plan, model=resolved_model(plan.model, plan.train.dtype))


def resolved_model(spec: ModelSpec, dtype: str) -> ModelSpec:
    """The model section with its shape numbers: as written for a built-in family, read off
    the captured graph for a custom model (so the memory and cost models can use them)."""
    if spec.family != "custom":
        return spec
    return model_profile(spec, dtype).shape


_CACHE: dict[tuple, ModelProfile | Unprofiled] = {}
_SOURCES = ("compiler/capture", "compiler/graph", "compiler/profile",
            "compiler/records/graph_meta.py", "models")


def cache_dir() -> Path:
    """Where profiles are kept between processes: $PTC_CACHE_DIR, else ~/.cache/ptc/profiles."""
    base = os.environ.get("PTC_CACHE_DIR")
    return Path(base) if base else Path.home() / ".cache" / "ptc" / "profiles"


def _load_or_capture(spec: ModelSpec, dtype: str, shards: tuple[ShardRule, ...],
                     key: tuple, fp8_recipe: str) -> ModelProfile | Unprofiled:
    root = Path(__file__).resolve().parents[2]  # ptc/
    digest = hashlib.sha256(repr((key, torch.__version__)).encode())
    for name in _SOURCES:
        folder = (root / name).is_dir()
        for path in sorted((root / name).rglob("*.py")) if folder else [root / name]:
            digest.update(path.read_bytes())
    digest.update(_factory_source(spec))
    path = cache_dir() / f"{digest.hexdigest()[:32]}.json"
    stored = _read(path)
    if stored is not None:
        return stored
    path.parent.mkdir(parents=True, exist_ok=True)
    with _only_one_profiler(path.with_suffix(".lock")):
        stored = _read(path)  # another process may have profiled it while this one waited
        if stored is not None:
            return stored
        try:
            profile = profile_one_layer(spec, dtype, shards, fp8_recipe)
        except CaptureError:
            raise  # not a profile's failure: the model cannot be trained at all
        except PtcError as exc:
            profile = Unprofiled(str(exc))
        try:
            write_profile(path, profile)
        except TypeError as exc:  # kept in this process only
            log.warning("profile of %s not cached on disk: %s", spec.family, exc)
    return profile


def _read(path: Path) -> ModelProfile | Unprofiled | None:
    """The profile cached at `path`, None when there is none; a damaged file is set aside
    (`*.damaged`) and the profile computed again."""
    if not path.exists():
        return None
    try:
        stored = read_profile(path)
    except Unreadable as exc:
        log.warning("profile cache: %s; profiling again", exc)
        path.replace(path.with_suffix(".damaged"))
        return None
    if isinstance(stored, Unprofiled):
        return stored
    return dataclasses.replace(stored, fn=profile_functions(stored), memo={})


@contextlib.contextmanager
def _only_one_profiler(lock_path: Path):
    """Hold an exclusive lock on `lock_path` while profiling: the ranks of a host start
    together and would each profile the same model (seconds of CPU apiece); the first
    profiles, the others wait and read its file. Where the file system has no locks,
    each profiles for itself, as before."""
    with open(lock_path, "a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:
            pass
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(lock, fcntl.LOCK_UN)


def _factory_source(spec: ModelSpec) -> bytes:
    """The source file of a custom model's factory (empty where there is none): editing the
    user's model invalidates its kept profile, or the reason it had none."""
    if spec.family != "custom" or not spec.factory:
        return b""
    try:
        path = inspect.getsourcefile(model_source().factory(spec.factory))
    except (TypeError, PtcError):  # a builtin, or nothing to import: the profile says why
        return b""
    return Path(path).read_bytes() if path else b""
