"""Per-shape profile of a model: closed-form per-layer quantities, read off its graph once.

The cost model and the plan search evaluate thousands of layouts; none of
them captures a graph. Instead a model *shape* (family, widths, vocab, dtype)
is captured once, with a single transformer layer, at six (b, s) points on
the meta device. Per graph region every quantity — saved activation bytes
(`activations`), forward FLOPs (capture's `NodeInfo.flops`) — is a
polynomial in b and s of degree <= 1 in b and <= 2 in s, so six points fix
it exactly; a seventh checks it. All layers of a block stack are alike, so
layer 0's polynomials times the layer count give the stack.

Regions: `pre` (embedding, before the first layer), `layer` (layer 0),
`post` (final norm, head, loss).

Classes of saved bytes within a region, which decide how parallelism divides
them:
- `tp`: made between a column-parallel linear (qkv, q, k, v, up, gate, the
  vocab-parallel head) and the row-parallel linear that closes the block
  (o, down): each tensor-parallel rank holds 1/t of it;
- `seq`: everything else that carries the batch (norm inputs, residual
  stream, dropout masks after the row-parallel linear): replicated over tp,
  split 1/t along the sequence with sequence parallelism;
- `const`: terms with no batch factor (a causal mask built from s): every
  rank holds them whole.
Each class is also split by whether selective recompute (of the attention
core as `recompute.attention_cores` finds it: scores to probabilities @ values,
or the fused kernel) drops it, and the
layer's *output* (what the next layer keeps as its input under full
recompute) is recorded separately, with the parts of the tensors crossing
the layer's two boundaries that no node saves (`ModelProfile.output_unsaved`,
`input_unsaved`): only a checkpoint or the pipeline runtime keeps those.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fcntl
import functools
from fractions import Fraction
import hashlib
import inspect
import math
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import sympy
import torch
import torch.fx

from ptc.compiler.activations import saved_and_output_storages
from ptc.compiler.gemm_tiles import GemmShape, fit_shapes, split_dim
from ptc.compiler.meta import copy_meta, get_info, graph_info
from ptc.compiler.nodes import (ATTENTION_OPS, CONVOLUTION_OPS, CROSS_ENTROPY_OPS, POINTWISE_OPS,
                                attention_parts, is_embedding, is_fp8_linear, is_linear,
                                linear_out_dim, linear_weight, logits_linear, node_shape,
                                op_name)
from ptc.compiler.recompute import (EXTRA_POLICIES, attention_cores, is_matmul,
                                    recompute_regions)
from ptc.compiler.tp_structure import (COLWISE, ROWWISE, VOCAB, Sharding, infer_sharding,
                                       matching_rule, rule_paths)
from ptc.compiler.work import GemmCall, graph_work
from ptc.errors import CaptureError, CompileError, PtcError, UnpricedError
from ptc.plan import ModelSpec, Plan, ShardRule

b, s = sympy.symbols("b s", positive=True, integer=True)
"""Micro-batch and sequence length symbols of every profile polynomial."""

_MONOMIALS = (sympy.Integer(1), s, s**2, b, b * s, b * s**2)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": torch.bfloat16}
"""Train dtype -> the dtype its model is captured in (fp8 keeps bf16 but for its GEMMs)."""


@dataclass(frozen=True, slots=True)
class SavedClasses:
    """Saved-activation bytes of one region, per micro-batch, unsharded, by class."""

    tp: sympy.Expr
    """Between column- and row-parallel linears: 1/t per tp rank."""
    seq: sympy.Expr
    """Replicated over tp; 1/t with sequence parallelism."""
    const: sympy.Expr
    """No batch factor: whole on every rank."""
    core_tp: sympy.Expr
    """Part of `tp` that selective recompute drops."""
    core_seq: sympy.Expr
    """Part of `seq` that selective recompute drops."""
    core_const: sympy.Expr
    """Part of `const` that selective recompute drops."""
    kv: sympy.Expr = sympy.Integer(0)
    """Part of `tp` made from the key/value projections alone, before k and v meet the
    queries: whole on every rank when tp exceeds the key/value heads (`kv_divisor`)."""
    core_kv: sympy.Expr = sympy.Integer(0)
    """Part of `kv` that selective recompute drops."""
    whole: sympy.Expr = sympy.Integer(0)
    """Part of `seq` that every tp rank keeps whole even with sequence parallelism: token
    ids and targets (the vocabulary-parallel embedding and loss read the whole sequence),
    a row-parallel linear's output that a saving region keeps (made before its
    reduce-scatter), and what a module kept whole by a rule saves where it mixes positions
    (`_whole_under_sp`)."""
    core_whole: sympy.Expr = sympy.Integer(0)
    """Part of `whole` that selective recompute drops (a whole attention's scores)."""

    @property
    def total(self) -> sympy.Expr:
        """All classes together (no parallelism, no recompute)."""
        return self.tp + self.seq + self.const


@dataclass(frozen=True, slots=True)
class ParamGroups:
    """Parameter elements of one region, by how tensor parallelism splits them."""

    split: int
    """Elements divided by t (column/row-parallel weights, column biases, vocab tables)."""
    replicated: int
    """Elements every tp rank holds whole (norms, row-parallel biases, positions)."""
    tensors: int
    """Parameter tensors (an optimizer keeps a step counter per tensor)."""
    kv: int = 0
    """Part of `split`: the key/value projections, whole on every rank when tp exceeds the
    key/value heads (`ModelProfile.kv_divisor`)."""

    @property
    def total(self) -> int:
        """All elements of the region."""
        return self.split + self.replicated


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """Everything the memory and cost models need to know about one model shape."""

    layers: int
    """Transformer layers L."""
    hidden: int
    """Hidden size h."""
    heads: int
    """Attention heads a."""
    kv_heads: int
    """Key/value heads of the attention (= heads without grouped-query attention)."""
    vocab: int
    """Vocabulary V."""
    dtype_bytes: int
    """Bytes per element of the compute dtype."""
    saved: dict[str, SavedClasses]
    """Saved activation bytes per region ("pre", "layer", "post")."""
    layer_output: SavedClasses
    """Bytes of a layer's output, whether or not a node after it saves that storage, and of
    any other storage of the layer that a node after it saves: all a fully recomputed layer
    keeps (its output is the next layer's checkpointed input, or a stage's output)."""
    output_unsaved: SavedClasses
    """Part of `layer_output` that no node after the layer saves (bf16 RMSNorm saves an fp32
    copy of its input, not the input): kept only by the next layer's checkpoint or by the
    pipeline runtime, so `saved["layer"]` leaves it out, and after the model's last layer
    nothing keeps it (`memory._chunk_ends`)."""
    input_unsaved: SavedClasses
    """Bytes of what the first layer reads from before it (its input) that no node saves:
    `saved["pre"]` leaves it out, a fully recomputed first layer's checkpoint keeps it."""
    flops: dict[str, sympy.Expr]
    """Forward FLOPs per region, per micro-batch."""
    core_flops: sympy.Expr
    """Forward FLOPs of one layer's attention core (what selective recompute reruns)."""
    kv_flops: sympy.Expr
    """Forward FLOPs of one layer's key/value path (its projections, RoPE on k): divided
    by `kv_divisor` rather than tp."""
    fp8_flops: sympy.Expr
    """Forward FLOPs of one layer's float8 GEMMs (`nodes.is_fp8_linear`) when profiled for
    train dtype "fp8", else 0."""
    work: dict[str, sympy.Expr]
    """What each region asks of the device per micro-batch (`ptc.compiler.work`), by
    "{region}.{phase}.{quantity}.{class}": region "pre", "layer", "post", "core" (the
    layer's attention core, part of "layer") or `rerun_region(policy)` (what one layer's
    recompute reruns under a policy of `policy_saved`, "fwd" only); phase "fwd" or "bwd";
    quantity "gemm" (FLOPs), "attn" (fused attention FLOPs), "mem" (bytes moved, each op its
    own kernel), "fmem" (bytes moved by fused kernels), "ops" (ops dispatched) and "kern"
    (kernels launched when fused; these two class "all" only); class "all", "tp" (the part
    tensor parallelism splits: between a column-parallel linear and the row-parallel one
    that closes the block, that one included), "kv" (the part of "tp" on the key/value
    path, split by `kv_divisor`) or "whole" (the part outside "tp" that sequence
    parallelism runs on the whole sequence: a module kept whole where it mixes positions,
    `_whole_under_sp`). Fitted for micro-batches of
    2 and more: at one sample torch's matmul views some operands it copies at more."""
    work_b1: dict[str, sympy.Expr]
    """`work` at a micro-batch of one sample, polynomials in s alone."""
    params: dict[str, ParamGroups]
    """Parameters per region; "post" excludes a head tied to the embedding."""
    tied: bool
    """Head and embedding share one weight."""
    tied_elements: int
    """Elements of the tied weight (0 when untied)."""
    boundary_elements: sympy.Expr
    """Elements of the tensor passed between layers (b·s·h): pipeline and TP traffic."""
    gemms: dict[str, tuple[GemmShape, ...]] = field(default_factory=dict)
    """The GEMMs of each region's phase ("{region}.{phase}", regions and phases as `work`)
    with their shapes (`ptc.compiler.gemm_tiles`), for micro-batches of 2 and more; a
    region's phase whose shapes do not fit is absent (priced by its FLOPs alone)."""
    gemms_b1: dict[str, tuple[GemmShape, ...]] = field(default_factory=dict)
    """`gemms` at a micro-batch of one sample."""
    policy_saved: dict[str, SavedClasses] = field(default_factory=dict)
    """Per recompute policy of `recompute.EXTRA_POLICIES` the model has: the saved bytes of
    one layer under it (what its nodes outside the policy's regions save, the regions'
    inputs, a saving region's matmul outputs), charged like `saved["layer"]`."""
    policy_flops: dict[str, sympy.Expr] = field(default_factory=dict)
    """Per policy of `policy_saved`: forward FLOPs of what it recomputes in one layer."""
    policy_gathers: dict[str, int] = field(default_factory=dict)
    """Per policy of `policy_saved`: the inputs of column-parallel linears one layer's regions
    recompute (a norm's output under `norm`) — under sequence parallelism each is an
    all-gather that backward's recompute reruns."""
    tp_entries: int = 2
    """Tensor-parallel regions one layer enters (distinct inputs of its column-parallel
    linears): an all-reduce of the input gradient each in backward (with sequence
    parallelism: an all-gather forward, a reduce-scatter backward)."""
    tp_exits: int = 2
    """Row-parallel linears of one layer: an all-reduce of the output each in forward (with
    sequence parallelism: a reduce-scatter forward, an all-gather backward)."""
    sp_gathered: sympy.Expr = sympy.Integer(0)
    """Bytes, whole, that sequence parallelism all-gathers in one layer's forward for modules
    a rule keeps whole (`_whole_under_sp`: the inputs of the ops mixing positions)."""
    sp_scattered: sympy.Expr = sympy.Integer(0)
    """Bytes, whole, of those modules' outputs scattered back to the split sequence: their
    gradients are all-gathered in backward."""
    sp_saved: dict[str, SavedClasses] = field(default_factory=dict)
    """Under sequence parallelism, where it runs something whole (`_whole_under_sp`): the
    saved bytes of every region of `saved`, of "out", "out_unsaved", "in_unsaved" and of
    every policy of `policy_saved`, measured on the graph as sequence parallelism lowers it
    (`_with_gathered_copies`): a split tensor that a whole op reads is gathered into a new
    whole tensor, kept besides the split one wherever both are kept (a saving region's
    linear output, split, and the attention's gathered input). Empty when sequence
    parallelism runs nothing whole: `saved` and the others hold then."""
    holds_input: frozenset[str] = frozenset({"full"})
    """Policies whose checkpoint keeps the layer's input (a region reads it): like "full",
    they keep what crosses into the layer whether or not a node saves it."""
    unavailable: dict[str, str] = field(default_factory=dict)
    """Policies the model's layers cannot take -> why (the CompileError's message)."""
    layer_paths: tuple[str, ...] = ()
    """The module paths of layer 0 that `shard` rules place (`tp_structure.rule_paths`),
    its index as "{}" ("layers.{}.mlp.up"): the profile prices every layer as layer 0, which
    holds only while the plan's rules place every layer alike (`_check_rules_alike`)."""
    shape: ModelSpec | None = None
    """For a custom model: its plan's model section with the shape its graph shows
    (`graph_shape`); None for a built-in family, whose plan names its shape."""
    fn: dict[str, Callable] = field(default_factory=dict, compare=False, repr=False)
    """The polynomials above as fast functions of (b, s), by dotted name ("layer.tp",
    "out.seq", "flops.post", "core_flops", "boundary"); they accept sympy symbols too."""
    memo: dict = field(default_factory=dict, compare=False, repr=False)
    """Cache of derived per-layer values, shared by copies that differ only in `layers`."""

    def kv_divisor(self, tp: int) -> int:
        """How many ways tensor parallelism of degree `tp` splits the key/value path: tp
        when tp divides the key/value heads, else 1 (fewer heads than ranks: replicated)."""
        return tp if self.kv_heads % tp == 0 else 1


def _shape_key(spec: ModelSpec) -> tuple:
    if spec.family == "custom":  # the factory and its arguments make the shape
        return spec.family, spec.factory, repr(sorted(spec.kwargs.items())), spec.max_seq
    return tuple(getattr(spec, f.name) for f in dataclasses.fields(spec)
                 if f.name not in ("layers", "spans", "kwargs"))


def model_profile(spec: ModelSpec, dtype: str,
                  shards: tuple[ShardRule, ...] = ()) -> ModelProfile:
    """The profile of `spec` at compute `dtype` ("bf16", ...) with the plan's `shard` rules
    deciding how tensor parallelism splits the linears they match (`plan_profile`); captured
    once per model shape and rules.

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
    key = (_shape_key(spec), dtype) + ((_rules_key(shards),) if shards else ())
    if key not in _CACHE:
        _CACHE[key] = _load_or_capture(spec, dtype, shards, key)
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
    dtype, split as its shard rules say."""
    return model_profile(plan.model, plan.train.dtype, plan.parallel.shards)


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


@dataclass(frozen=True, slots=True)
class Unprofiled:
    """What `model_profile` keeps for a model it cannot profile: the reason, said again."""

    reason: str


_CACHE: dict[tuple, ModelProfile | Unprofiled] = {}
_SAVED_REGIONS = ("pre", "layer", "post", "out", "out_unsaved", "in_unsaved")
"""Keys of `_measure`'s saved bytes: the graph regions and `ModelProfile`'s boundary terms."""
_SOURCES = ("compiler/capture", "compiler/activations.py", "compiler/profile.py",
            "compiler/recompute.py", "compiler/flops.py", "compiler/work.py",
            "compiler/nodes.py", "compiler/meta.py", "compiler/masks.py",
            "compiler/tp_structure.py", "compiler/gemm_tiles.py", "models")


def cache_dir() -> Path:
    """Where profiles are kept between processes: $PTC_CACHE_DIR, else ~/.cache/ptc/profiles."""
    base = os.environ.get("PTC_CACHE_DIR")
    return Path(base) if base else Path.home() / ".cache" / "ptc" / "profiles"


def _load_or_capture(spec: ModelSpec, dtype: str, shards: tuple[ShardRule, ...],
                     key: tuple) -> ModelProfile | Unprofiled:
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(repr((key, torch.__version__)).encode())
    for name in _SOURCES:
        for path in sorted((root / name).rglob("*.py")) if (root / name).is_dir() else [root / name]:
            digest.update(path.read_bytes())
    digest.update(_factory_source(spec))
    path = cache_dir() / f"{digest.hexdigest()[:32]}.pkl"
    if path.exists():
        return _read(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _only_one_profiler(path.with_suffix(".lock")):
        if path.exists():  # another process profiled it while this one waited
            return _read(path)
        try:
            profile = _profile_one_layer(spec, dtype, shards)
        except CaptureError:
            raise  # not a profile's failure: the model cannot be trained at all
        except PtcError as exc:
            profile = Unprofiled(str(exc))
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(pickle.dumps(profile if isinstance(profile, Unprofiled)
                                     else dataclasses.replace(profile, fn={}, memo={})))
        tmp.replace(path)  # atomic: a concurrent reader sees no file or the whole new one
    return profile


def _read(path: Path) -> ModelProfile | Unprofiled:
    stored = pickle.loads(path.read_bytes())
    if isinstance(stored, Unprofiled):
        return stored
    return dataclasses.replace(stored, fn=_functions(stored), memo={})


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
    from ptc.models.build import resolve_factory  # noqa: PLC0415 - the model zoo

    if spec.family != "custom" or not spec.factory:
        return b""
    try:
        path = inspect.getsourcefile(resolve_factory(spec.factory))
    except (TypeError, PtcError):  # a builtin, or nothing to import: the profile says why
        return b""
    return Path(path).read_bytes() if path else b""


def _profile_one_layer(spec: ModelSpec, dtype: str, shards: tuple[ShardRule, ...]
                       ) -> ModelProfile:
    """Capture the model at seven (b, s) points and fit every term; a built-in family with
    one layer, a custom model whole (its first layer stands for the others). `shards`: the
    rules that override how tensor parallelism splits a linear (`infer_sharding`)."""
    from ptc.compiler.capture import capture  # noqa: PLC0415 - capture needs the model zoo
    from ptc.models import build_model  # noqa: PLC0415

    custom = spec.family == "custom"
    model = build_model(spec if custom else dataclasses.replace(spec, layers=1), device="meta")
    config = getattr(model, "config", None)  # a transformers model says how long it may be
    max_seq = spec.max_seq or getattr(config, "max_position_embeddings", None)
    points = _points(max_seq or 64)
    samples, first = [], None
    work_samples: dict[tuple[int, int], dict[str, int]] = {}
    gemm_samples: dict[tuple[int, int], dict[str, list]] = {}
    for pb, ps in dict.fromkeys(points + _work_points(points)):  # each graph measured first
        gm = capture(model, micro_batch=pb, seq_len=ps, dtype=DTYPES[dtype],
                     buffers_as_built=True)  # as the runtime binds them
        split = infer_sharding(gm, shards)
        if (pb, ps) in points:
            samples.append(_measure(gm, split, fp8=dtype == "fp8"))
            gathered = _with_gathered_copies(gm, split)
            if gathered is not None:
                samples[-1].update({f"sp:{name}": value for name, value in _measure(
                    gathered, split, fp8=dtype == "fp8").items() if _is_saved_term(name)})
        work_samples[pb, ps], gemm_samples[pb, ps] = _work(gm, split)
        if first is None:  # a custom model whose shape cannot be read says so before the rest
            if custom and not graph_info(gm).num_layers:
                raise PtcError(f"model \"{spec.factory}\": ptc finds no stack of like layers "
                               f"(a ModuleList of blocks) in {type(model).__name__}, and its "
                               "memory and cost models price a model layer by layer, so ptc "
                               "cannot predict its memory or step time; compile, inspect and "
                               "run work without predictions")
            unlike = custom and _layers_unlike(gm)
            if unlike:
                raise PtcError(f"model \"{spec.factory}\": its layers are not alike ({unlike}), "
                               "and ptc's memory and cost models price every layer as its "
                               "first, so ptc cannot predict its memory or step time; compile, "
                               "inspect and run work without predictions")
            first, sharding = gm, split
            shape = graph_shape(gm, dataclasses.replace(spec, max_seq=max_seq),
                                infer_sharding(gm)) \
                if custom else spec
    fit = {name: _fit(points[:6], [smp[name] for smp in samples[:6]]) for name in samples[0]}
    pb, ps = points[6]
    bad = [name for name, poly in fit.items() if poly.subs({b: pb, s: ps}) != samples[6][name]]
    work, work_b1, bad_work = _fit_work(points, work_samples)
    gemms, gemms_b1 = _fit_gemms(points, gemm_samples)
    for name in bad + bad_work:  # the last point of each fit checks its polynomial form
        if custom:
            what = "work on the device" if name in bad_work else "saved activations"
            raise PtcError(f"model \"{spec.factory}\": its {what} ({name}) is "
                           "not the polynomial in micro-batch and sequence length that "
                           "ptc's memory and cost models fit, so ptc cannot predict its memory "
                           "or step time; compile, inspect and run work without predictions")
        raise ValueError(f"profile term {name} is not polynomial in b, s of the expected degree")
    params, tied_elements = _param_groups(first, sharding)
    tp_entries, tp_exits = _tp_regions(first, sharding)
    saved = {r: _classes(fit, r) for r in _SAVED_REGIONS}
    policies = [p for p in EXTRA_POLICIES if f"{p}.tp" in fit]
    sp_saved = {r: _classes(fit, f"sp:{r}") for r in (*_SAVED_REGIONS, *policies)
                if f"sp:{r}.tp" in fit}
    unavailable = _unavailable(first)
    blocks = graph_info(first).blocks_path
    layer_paths = tuple(sorted(f"{blocks}.{{}}.{p[len(blocks) + 3:]}" for p in rule_paths(first)
                               if blocks and p.startswith(f"{blocks}.0.")))
    profile = ModelProfile(
        layers=1, hidden=shape.hidden, heads=shape.heads, kv_heads=shape.num_kv_heads,
        vocab=shape.vocab,
        dtype_bytes=DTYPES[dtype].itemsize,
        saved={r: saved[r] for r in ("pre", "layer", "post")}, layer_output=saved["out"],
        output_unsaved=saved["out_unsaved"], input_unsaved=saved["in_unsaved"],
        flops={r: fit[f"{r}.flops"] for r in ("pre", "layer", "post")},
        core_flops=fit["core.flops"], kv_flops=fit["kv.flops"], fp8_flops=fit["fp8.flops"],
        work=work, work_b1=work_b1, gemms=gemms, gemms_b1=gemms_b1,
        policy_saved={p: _classes(fit, p) for p in policies},
        policy_flops={p: fit[f"{p}.flops"] for p in policies},
        policy_gathers={p: int(fit[f"{p}.gathers"]) for p in policies},
        tp_entries=tp_entries, tp_exits=tp_exits, sp_gathered=fit["sp.gathered"],
        sp_scattered=fit["sp.scattered"], sp_saved=sp_saved,
        holds_input=frozenset({"full", *(p for p in policies if fit[f"{p}.holds"])}),
        unavailable=unavailable, layer_paths=layer_paths, params=params, tied=tied_elements > 0,
        tied_elements=tied_elements, boundary_elements=b * s * shape.hidden,
        shape=shape if custom else None)
    return dataclasses.replace(profile, fn=_functions(profile))


def _layers_unlike(gm: torch.fx.GraphModule) -> str | None:
    """How the first layer of a model captured whole differs from another in the parameters
    it reads (a dense first layer before mixture-of-experts ones, convolution layers among
    attention ones), or None when all read as many. Layers that differ only in their ops
    (one without RoPE, a sliding window) are priced as the first."""
    params: dict[int, int] = {}
    for n in gm.graph.nodes:
        info = get_info(n)
        if info is not None and info.layer is not None:
            params[info.layer] = params.get(info.layer, 0) + (info.params or 0)
    first = params.get(0, 0)
    other = next((layer for layer, count in sorted(params.items()) if count != first), None)
    if other is None:
        return None
    return (f"layer 0 reads {first:,} parameter elements, layer {other} "
            f"{params[other]:,}")


def graph_shape(gm: torch.fx.GraphModule, spec: ModelSpec, sharding: Sharding) -> ModelSpec:
    """`spec` with the shape numbers a captured graph shows: layers, hidden size, heads and
    key/value heads of the first attention, MLP inner size, vocabulary (a custom model's
    plan names none of them); `sharding`: the split the graph implies (`infer_sharding`)."""
    info = graph_info(gm)
    attention = next((p for n in gm.graph.nodes if (p := attention_parts(n)) is not None), None)
    q = node_shape(attention.q) if attention is not None else None
    k = node_shape(attention.k) if attention is not None else None
    hidden = ffn = None
    projections = []  # the first attention's q/k/v linears: output features each
    for n in gm.graph.nodes:
        path = is_linear(n) or is_embedding(n)
        style, why = sharding.styles.get(path), sharding.why.get(path, "")
        if hidden is None and style == VOCAB and is_embedding(n):
            hidden = node_shape(n)[-1]
        if ffn is None and why == "MLP output projection":
            ffn = node_shape(n.args[0])[-1]
        if why.startswith("attention q/k/v") and get_info(n).layer == 0:
            projections.append(node_shape(n)[-1])
    if hidden is None or q is None:
        raise PtcError(f"model \"{spec.factory}\": no token embedding or attention found in its "
                       "graph, so ptc cannot predict its memory or step time; compile, inspect "
                       "and run work without predictions")
    heads, head_dim = q[-3], q[-1]
    # Key/value heads from the projections (the attention may see them repeated): k's
    # features, or what a fused qkv holds besides q's.
    kv_features = projections[1] if len(projections) == 3 else \
        (projections[0] - heads * head_dim) // 2 if len(projections) == 1 else None
    kv_heads = kv_features // head_dim if kv_features else (k[-3] if k is not None else None)
    return dataclasses.replace(spec, layers=info.num_layers, hidden=hidden, heads=heads,
                               kv_heads=kv_heads, ffn=ffn,
                               vocab=info.vocab, max_seq=spec.max_seq or info.seq_len)


def _functions(profile: ModelProfile) -> dict[str, Callable]:
    """The profile's polynomials as fast functions of (b, s), by dotted name."""
    regions = {**profile.saved, "out": profile.layer_output,
               "out_unsaved": profile.output_unsaved, "in_unsaved": profile.input_unsaved,
               **profile.policy_saved}
    regions.update({f"sp:{r}": cl for r, cl in profile.sp_saved.items()})
    polys = {f"{r}.{c.name}": getattr(cl, c.name) for r, cl in regions.items()
             for c in dataclasses.fields(SavedClasses)}
    polys.update({f"flops.{r}": e for r, e in profile.flops.items()})
    polys.update({f"flops.{p}": e for p, e in profile.policy_flops.items()})
    polys.update(core_flops=profile.core_flops, kv_flops=profile.kv_flops,
                 fp8_flops=profile.fp8_flops,
                 boundary=profile.boundary_elements, sp_gathered=profile.sp_gathered,
                 sp_scattered=profile.sp_scattered)
    fns = {name: sympy.lambdify((b, s), e, modules="math") for name, e in polys.items()}
    # The work terms are many (hundreds) and only ever priced in numbers: plain polynomials
    # of their float coefficients, which take a fraction of lambdify's time to make.
    fns.update({f"{prefix}.{name}": _numeric(e) for prefix, terms in
                (("work", profile.work), ("work_b1", profile.work_b1)) for name, e in terms.items()})
    return fns


def _numeric(e: sympy.Expr) -> Callable[[float, float], float]:
    """`e`, a polynomial in b and s, as a function of numbers (b, s)."""
    terms = tuple((float(c), int(m.as_powers_dict().get(b, 0)), int(m.as_powers_dict().get(s, 0)))
                  for m, c in sympy.expand(e).as_coefficients_dict().items())
    return lambda bb, ss: sum(c * bb**i * ss**j for c, i, j in terms)


def _classes(fit: dict[str, sympy.Expr], region: str) -> SavedClasses:
    """Split measured tp/seq bytes into their batch terms and the batch-free `const`."""
    def split(name: str) -> tuple[sympy.Expr, sympy.Expr]:
        poly = fit[f"{region}.{name}"]
        free = poly.subs(b, 0)
        return sympy.expand(poly - free), free

    (tp, tp0), (seq, seq0) = split("tp"), split("seq")
    (ctp, ctp0), (cseq, cseq0) = split("core_tp"), split("core_seq")
    (kv, _), (ckv, _) = split("kv"), split("core_kv")  # their batch-free part is in `const`
    (whole, _), (cwhole, _) = split("whole"), split("core_whole")
    return SavedClasses(tp=tp, seq=seq, const=tp0 + seq0,
                        core_tp=ctp, core_seq=cseq, core_const=ctp0 + cseq0, kv=kv, core_kv=ckv,
                        whole=whole, core_whole=cwhole)


def _points(max_seq: int) -> list[tuple[int, int]]:
    q = max(1, min(max_seq, 64) // 4)
    # A 2 x 3 grid fixes {1, b} x {1, s, s^2}; (4, 4q) checks the fit. Micro-batches 2 and 3:
    # at b = 1 a batched matmul of a transposed operand (q @ k^T written out) saves a view of
    # it, from b = 2 on a copy, so a term that keeps the operand's storage besides (op-level
    # recompute of a norm keeps the qkv output) is polynomial from b = 2 on; at b = 1 it is
    # that storage too high (conservative).
    return [(pb, k * q) for pb in (2, 3) for k in (1, 2, 3)] + [(4, 4 * q)]


def _fit(points: list[tuple[int, int]], values: list[int]) -> sympy.Expr:
    coeffs = _inverse(tuple(points)) * sympy.Matrix(values)
    return sympy.expand(sum(c * m for c, m in zip(coeffs, _MONOMIALS)))


@functools.cache
def _inverse(points: tuple[tuple[int, int], ...]) -> sympy.Matrix:
    """The inverse of the monomials' values at `points` (exact rationals): shared by every
    term fitted at the same points."""
    return sympy.Matrix([[m.subs({b: pb, s: ps}) for m in _MONOMIALS] for pb, ps in points]).inv()


def _regions(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Node name -> "pre" / "layer" (layer 0) / "later" (layers after it) / "post"."""
    region, seen_layer = {}, False
    for n in gm.graph.nodes:
        info = get_info(n)
        if n.op == "get_attr":  # where its readers are (the export door puts them first)
            continue
        if info is not None and info.layer is not None:
            region[n.name], seen_layer = "layer" if info.layer == 0 else "later", True
        else:
            region[n.name] = "post" if seen_layer else "pre"
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            users = [region[u.name] for u in n.users if u.name in region]
            region[n.name] = users[0] if users else "pre"
    return region


def _styles(gm: torch.fx.GraphModule, sharding: Sharding) -> dict[str, str]:
    """Node name -> tensor-parallel style of the linear or embedding it applies."""
    return {n.name: sharding.styles[path] for n in gm.graph.nodes
            if (path := is_linear(n) or is_embedding(n)) and path in sharding.styles}


def _tp_sharded(gm: torch.fx.GraphModule, sharding: Sharding) -> set[str]:
    """Nodes whose output each tp rank holds 1/t of: from a column-parallel linear (or the
    vocabulary-parallel head) to the row-parallel linear that closes the block."""
    styles = _styles(gm, sharding)
    sharded: set[str] = set()
    for n in gm.graph.nodes:
        style = styles.get(n.name)
        if style == COLWISE or (style == VOCAB and is_linear(n)):
            sharded.add(n.name)
        elif style != ROWWISE and any(a.name in sharded for a in n.all_input_nodes):
            sharded.add(n.name)
    return sharded


def _kv_path(gm: torch.fx.GraphModule, sharding: Sharding, sharded: set[str]) -> set[str]:
    """Nodes of the tp-sharded set computed from key/value projections alone: the linears
    and what works on k or v before the attention pairs them with the queries."""
    kv: set[str] = set()
    for n in gm.graph.nodes:
        if n.name not in sharded:
            continue
        inputs = {a.name for a in n.all_input_nodes if a.name in sharded}
        if is_linear(n) in sharding.kv_projections or (
                inputs and not is_linear(n) and inputs <= kv):
            kv.add(n.name)
    return kv


def _whole_under_sp(gm: torch.fx.GraphModule, sharded: set[str]) -> set[str]:
    """Nodes outside the tp regions that sequence parallelism runs on the whole sequence,
    as `ptc.passes.sequence_parallel` lowers them: an op that mixes positions (an attention,
    a product of two activations, a convolution) on activations a rule keeps whole, or a
    head kept whole whose logits reach the loss, gets them gathered, and what follows it
    stays whole until an elementwise op meets the split sequence again (the residual add,
    where the whole operand is scattered). Not modelled: an embedding kept whole, whose
    output runs whole into the first layer up to its first residual add."""
    data = _activations(gm)
    heads = {head.name for n in gm.graph.nodes if op_name(n) in CROSS_ENTROPY_OPS
             and (head := logits_linear(n)) is not None}
    whole: set[str] = set()
    for n in gm.graph.nodes:
        inputs = [a.name for a in n.all_input_nodes if a.name in data]
        if n.name not in data or n.name in sharded or not inputs:
            continue
        name = op_name(n)
        if n.target is gathered_copy:
            whole.add(n.name)
        elif any(a in whole for a in inputs):
            if name not in POINTWISE_OPS or all(a in whole or a in sharded for a in inputs):
                whole.add(n.name)
        elif name in ATTENTION_OPS or name in CONVOLUTION_OPS or n.name in heads or (
                name in _ACTIVATION_PRODUCTS and len(inputs) >= 2):
            whole.add(n.name)
    return whole


def gathered_copy(x: torch.Tensor) -> torch.Tensor:
    """Stand-in for sequence parallelism's `gather_seq` in the one-process profile: a new
    tensor laid out as its input, as the gather makes one (of the whole sequence)."""
    return x.clone(memory_format=torch.preserve_format)


def _with_gathered_copies(gm: torch.fx.GraphModule, sharding: Sharding
                          ) -> torch.fx.GraphModule | None:
    """A copy of `gm` as sequence parallelism lowers what it runs whole: each split input of
    a node it runs whole (`_whole_under_sp`) is read through a `gathered_copy` of its own,
    where the sequence_parallel pass inserts a `gather_seq` for that node. None when it
    runs nothing whole.

    Measured on it, a whole op's saved input is the gathered copy, a storage apart from
    the split tensor it came from: the two count separately where both are kept, and the
    recompute regions meet the copies where they meet the gathers.
    """
    sharded = _tp_sharded(gm, sharding)
    whole, data = _whole_under_sp(gm, sharded), _activations(gm)
    edges = [(n.name, a.name) for n in gm.graph.nodes if n.name in whole
             for a in n.all_input_nodes
             if a.name in data and a.name not in whole and a.name not in sharded
             and _output_bytes(a)]  # a tensor: not a size read off one
    if not edges:
        return None
    out = copy.deepcopy(gm)
    nodes = {n.name: n for n in out.graph.nodes}
    for user_name, input_name in edges:
        user, x = nodes[user_name], nodes[input_name]
        with out.graph.inserting_before(user):
            gathered = out.graph.call_function(gathered_copy, (x,))
        copy_meta(x, gathered, kind="other", flops=0, params=0, param_bytes=0)
        user.replace_input_with(x, gathered)
    out.recompile()
    return out


def _is_saved_term(name: str) -> bool:
    """Whether a `_measure` term is saved bytes (a region's or a policy's class), not FLOPs,
    gathers or communication."""
    region, _, what = name.rpartition(".")
    return bool(region) and what in _SAVED_CLASS_TERMS


_SAVED_CLASS_TERMS = ("tp", "seq", "core_tp", "core_seq", "kv", "core_kv", "whole", "core_whole")
"""The classes `_measure` reports saved bytes in (`SavedClasses`, before `_classes`)."""


_ACTIVATION_PRODUCTS = frozenset({"matmul", "bmm", "baddbmm", "einsum"})
"""Products that mix positions when both operands are activations (scores, probs @ v)."""


def _activations(gm: torch.fx.GraphModule) -> set[str]:
    """Nodes made from the graph's inputs (not tables built from sizes, not weights)."""
    data: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder" or (n.op != "output" and any(
                a.name in data for a in n.all_input_nodes)):
            data.add(n.name)
    return data


def _sp_moves(gm: torch.fx.GraphModule, region: dict[str, str], sharded: set[str],
              whole: set[str]) -> dict[str, int]:
    """Bytes of layer 0 that sequence parallelism moves for what it runs whole: the split
    inputs it gathers ("sp.gathered") and the whole outputs it scatters back
    ("sp.scattered", gathered again as gradients in backward)."""
    gathered, scattered, data = set(), set(), _activations(gm)
    for n in gm.graph.nodes:
        if region.get(n.name) != "layer":
            continue
        inputs = [a for a in n.all_input_nodes if a.name in data]
        if n.name in whole:
            gathered.update(a for a in inputs if a.name not in whole and a.name not in sharded)
        elif n.name not in sharded:
            scattered.update(a for a in inputs if a.name in whole)
    return {"sp.gathered": sum(_output_bytes(a) for a in gathered),
            "sp.scattered": sum(_output_bytes(a) for a in scattered)}


def _output_bytes(node: torch.fx.Node) -> int:
    """Bytes of the node's (first) tensor output; 0 for a number (a size read off it)."""
    info = get_info(node)
    if info is None or not info.shapes or not info.dtypes:
        return 0
    return math.prod(info.shapes[0]) * info.dtypes[0].itemsize


def _tp_regions(gm: torch.fx.GraphModule, sharding: Sharding) -> tuple[int, int]:
    """(regions entered, regions left) in layer 0 as the tensor_parallel pass splits it: the
    distinct inputs of its column-parallel linears, and its row-parallel linears."""
    region = _regions(gm)
    styles = _styles(gm, sharding)
    layer = [n for n in gm.graph.nodes if region[n.name] == "layer"]
    entries = {n.args[0] for n in layer if styles.get(n.name) == COLWISE and n.args}
    return len(entries), sum(styles.get(n.name) == ROWWISE for n in layer)


def _saved_whole(storage, whole: set[str]) -> bool:
    """Whether sequence parallelism keeps `storage` whole: made by a node it runs whole, or
    saved only by such nodes (which read it gathered)."""
    return storage.producer in whole or (
        bool(storage.savers) and all(x in whole for x in storage.savers))


def _inputs(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    tensors = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            info = get_info(n)
            tensors.append(torch.zeros(info.shapes[0], dtype=info.dtypes[0], device="meta"))
    return tensors


def _measure(gm: torch.fx.GraphModule, sharding: Sharding, *,
             fp8: bool = False) -> dict[str, int]:
    """Saved bytes by region and class, and FLOPs by region, of one capture split as
    `sharding` says; `fp8`: as the float8 GEMMs of train dtype "fp8" save their inputs
    (`_with_fp8_copies`)."""
    region, sharded = _regions(gm), _tp_sharded(gm, sharding)
    # What selective recompute reruns: the regions the activation_checkpoint pass makes.
    core = {n.name for c in attention_cores(_layer_nodes(gm, region)) for n in c}
    kv_path = _kv_path(gm, sharding, sharded)
    out = {f"{r}.{c}": 0 for r in _SAVED_REGIONS
           for c in _SAVED_CLASS_TERMS}
    whole = _whole_under_sp(gm, sharded)
    placeholders = _placeholders(gm)
    storages, outputs = saved_and_output_storages(gm, _inputs(gm),
                                                  held=_boundaries(gm, region))
    fp8_linears = {n.name for n in gm.graph.nodes if fp8 and is_fp8_linear(n)}
    for st in storages:
        nbytes = _with_fp8_copies(st, fp8_linears)
        cls = "tp" if st.producer in sharded else "seq"
        # A graph input (targets) belongs where it is used.
        r = region[st.savers[0] if st.producer in placeholders and st.savers
                   else st.producer]
        if r == "later":  # layers after the first are alike: layer 0 stands for them
            continue
        kept_after = [x for x in st.savers if region[x] != "layer"]
        if not st.savers:  # held by a fully recomputed layer's checkpoint, as its input
            targets = ("out", "out_unsaved") if r == "layer" else ("in_unsaved",)
        elif r == "layer" and (kept_after or st.held):
            # Kept after the layer: by a node after it, or as the next layer's input.
            targets = (r, "out") if kept_after else (r, "out", "out_unsaved")
        else:
            targets = (r,)
        # Selective recompute drops what the core saves of what it makes; a saver after the
        # core still keeps the storage (or, a float8 GEMM, its own copy of it).
        dropped = nbytes - _with_fp8_copies(st, fp8_linears, [x for x in st.savers
                                                              if x not in core]) \
            if st.producer in core else 0
        kept_whole = st.producer in placeholders or _saved_whole(st, whole)
        for target in targets:
            if kept_whole:  # token ids, targets, a whole module's: whole on every tp rank
                out[f"{target}.whole"] += nbytes
                out[f"{target}.core_whole"] += dropped
            for c in (cls, "kv") if st.producer in kv_path else (cls,):
                out[f"{target}.{c}"] += nbytes
                out[f"{target}.core_{c}"] += dropped
    # Selective recompute keeps the core's inputs, whether or not backward saved them: the
    # storages they view (a transposed v is its projection's output) that nothing saves.
    saved_keys, added = {st.key for st in storages if st.savers}, set()
    for n in gm.graph.nodes:
        if n.name in core or n.op in ("get_attr", "placeholder") or region[n.name] == "later" \
                or not any(u.name in core for u in n.users):
            continue
        for key, (nbytes, producer) in outputs.get(n.name, {}).items():
            if key in saved_keys or key in added or region.get(producer) != region[n.name]:
                continue
            added.add(key)
            cls = "tp" if producer in sharded else "seq"
            for c in (cls, "kv") if producer in kv_path else (cls,):
                out[f"{region[n.name]}.core_{c}"] -= nbytes
            if producer in whole or any(u.name in whole for u in n.users if u.name in core):
                out[f"{region[n.name]}.core_whole"] -= nbytes
    out.update(_sp_moves(gm, region, sharded, whole))
    whole_keys = {st.key for st in storages if _saved_whole(st, whole)} | {
        key for name in whole for key in outputs.get(name, {})}
    out.update(_policy_terms(gm, storages, outputs, region, sharded, kv_path, sharding,
                             whole_keys, fp8_linears))
    out.update({f"{r}.flops": 0 for r in ("pre", "layer", "post", "core", "kv", "fp8")})
    for n in gm.graph.nodes:
        info = get_info(n)
        if info is not None and info.flops and region[n.name] != "later":
            out[f"{region[n.name]}.flops"] += info.flops
            if n.name in core and region[n.name] == "layer":
                out["core.flops"] += info.flops
            if n.name in kv_path and region[n.name] == "layer":
                out["kv.flops"] += info.flops
            if n.name in fp8_linears and region[n.name] == "layer":
                out["fp8.flops"] += info.flops
    return out


def _layer_nodes(gm: torch.fx.GraphModule, region: dict[str, str]) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if region[n.name] == "layer"
            and n.op in ("call_module", "call_function", "call_method")]


def _unavailable(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Policies of EXTRA_POLICIES layer 0 cannot take -> the CompileError's message."""
    nodes, out = _layer_nodes(gm, _regions(gm)), {}
    for policy in EXTRA_POLICIES:
        try:
            recompute_regions(nodes, policy, 0)
        except CompileError as err:
            out[policy] = str(err)
    return out


def _policy_terms(gm: torch.fx.GraphModule, storages, outputs, region: dict[str, str],
                  sharded: set[str], kv_path: set[str], sharding: Sharding,
                  whole_keys: set[int], fp8_linears: set[str]) -> dict[str, int]:
    """Per policy of EXTRA_POLICIES layer 0 can take: the bytes of the storages layer 0
    makes that stay kept under it, by class (`{policy}.tp`, `.seq`, `.kv`, `.whole`), the
    FLOPs it recomputes (`.flops`), whether a region reads the layer's input (`.holds`) and
    how many inputs of column-parallel linears its regions recompute (`.gathers`).

    Kept: what a node outside the regions saves, each region's inputs (torch's
    checkpoint holds them) and a saving region's matmul outputs, with the
    log-sum-exp of a fused attention kernel: its selective checkpoint caches
    every output of those aten ops (not the operand copies a batched matmul
    makes around its bmm: they are recomputed).
    """
    nodes, out = _layer_nodes(gm, region), {}
    crossing = _boundaries(gm, region)
    styles = _styles(gm, sharding)
    rowwise = {name for name, style in styles.items() if style == ROWWISE}
    for policy in EXTRA_POLICIES:
        try:
            regions = recompute_regions(nodes, policy, 0)
        except CompileError:
            continue
        inside = {n.name for r in regions for n in r.nodes}
        kept_nodes = {n.name for r in regions if r.saving for n in r.nodes if is_matmul(n)}
        read = {a.name for r in regions for n in r.nodes for a in n.all_input_nodes
                if a not in r.nodes and a.op != "get_attr"}
        # Per storage: its bytes kept whole, and the float8 copies the GEMMs after the
        # regions keep of it (`_with_fp8_copies`).
        whole_kept: dict[int, tuple[int, str]] = {}
        copies: dict[int, tuple[int, str]] = {}
        for st in storages:
            after = [x for x in st.savers if x not in inside]
            if not after:
                continue
            whole, copy_bytes = _kept_as(st, fp8_linears, after)
            if whole:
                whole_kept[st.key] = (st.nbytes, st.producer)
            if copy_bytes:
                copies[st.key] = (copy_bytes, st.producer)
        for name in read | kept_nodes:  # the regions' inputs and kept matmul outputs
            whole_kept.update(outputs.get(name, {}))
        kernels = {n.name for r in regions if r.saving for n in r.nodes
                   if (parts := attention_parts(n)) is not None and parts.fused}
        whole_kept.update({st.key: (st.nbytes, st.producer) for st in storages
                           if st.internal and st.producer in kernels})
        kept = [*whole_kept.items(), *copies.items()]
        terms = dict.fromkeys(_SAVED_CLASS_TERMS, 0)
        for key, (nbytes, producer) in kept:
            if region.get(producer) != "layer":
                continue
            terms["tp" if producer in sharded else "seq"] += nbytes
            if producer in kv_path:
                terms["kv"] += nbytes
            if (producer in rowwise and producer in kept_nodes  # before its reduce-scatter
                    or key in whole_keys):  # a whole module's (`_whole_under_sp`)
                terms["whole"] += nbytes
        out.update({f"{policy}.{c}": v for c, v in terms.items()})
        out[f"{policy}.flops"] = sum(get_info(n).flops for r in regions for n in r.nodes
                                     if get_info(n) is not None and n.name not in kept_nodes)
        out[f"{policy}.holds"] = int(bool(read & crossing) and any(
            region[name] != "layer" for name in read))
        members = {n.name for r in regions for n in r.nodes}
        out[f"{policy}.gathers"] = len({n.args[0].name for n in nodes
                                        if styles.get(n.name) == COLWISE and n.name in members
                                        and isinstance(n.args[0], torch.fx.Node)
                                        and n.args[0].name in inside})
    return out


WORK_REGIONS = ("pre", "layer", "post", "core")
WORK_QUANTITIES = ("gemm", "attn", "mem", "fmem", "ops", "kern")
COUNTS = ("ops", "kern")
"""Quantities that count calls, taken whole on every rank (class "all" only)."""
WORK_CLASSES = ("all", "tp", "kv", "whole")


def _work_points(points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Where the work terms are measured besides `points`: one sample at the grid's and
    the check's sequence lengths."""
    return [(1, ps) for ps in dict.fromkeys(ps for _, ps in points)]


def _fit_work(points: list[tuple[int, int]], samples: dict[tuple[int, int], dict[str, int]]
              ) -> tuple[dict[str, sympy.Expr], dict[str, sympy.Expr], list[str]]:
    """(work for b >= 2 in b and s, work for b = 1 in s, names whose check failed): fitted
    on `points`' grid and checked at its last point, and on one sample at the grid's three
    sequence lengths, checked at the last point's. Solved in exact fractions (hundreds of
    terms: sympy's own solving would take seconds)."""
    ones = _work_points(points)
    fits = ((points[:6], points[6], _MONOMIALS), (ones[:3], ones[3], _MONOMIALS[:3]))
    out: tuple[dict[str, sympy.Expr], dict[str, sympy.Expr]] = ({}, {})
    bad = []
    for name in samples[points[0]]:
        for (grid, check, monomials), fitted in zip(fits, out):
            inverse = _fraction_inverse(tuple(grid), monomials)
            values = [samples[pt][name] for pt in grid]
            coeffs = [sum(x * v for x, v in zip(row, values)) for row in inverse]
            if sum(c * _value(m, check) for c, m in zip(coeffs, monomials)) != samples[check][name]:
                bad.append(name)
            fitted[name[len("work."):]] = sympy.Add(*(sympy.Rational(c.numerator, c.denominator) * m
                                                      for c, m in zip(coeffs, monomials)))
    return *out, bad


def _value(m: sympy.Expr, point: tuple[int, int]) -> int:
    powers = m.as_powers_dict()
    return point[0] ** int(powers.get(b, 0)) * point[1] ** int(powers.get(s, 0))


@functools.cache
def _fraction_inverse(points: tuple[tuple[int, int], ...], monomials: tuple[sympy.Expr, ...]
                      ) -> list[list[Fraction]]:
    """The inverse of `monomials`' values at `points`, in fractions."""
    matrix = sympy.Matrix([[_value(m, pt) for m in monomials] for pt in points]).inv()
    return [[Fraction(int(x.p), int(x.q)) for x in matrix.row(i)] for i in range(matrix.rows)]


def _reruns(gm: torch.fx.GraphModule, region: dict[str, str]) -> dict[str, set[str]]:
    """Per policy of EXTRA_POLICIES layer 0 can take: the nodes its recompute reruns (every
    node of its regions but a saving region's matmuls, whose outputs are kept)."""
    nodes, out = _layer_nodes(gm, region), {}
    for policy in EXTRA_POLICIES:
        try:
            regions = recompute_regions(nodes, policy, 0)
        except CompileError:
            continue
        out[policy] = {n.name for r in regions for n in r.nodes
                       if not (r.saving and is_matmul(n))}
    return out


def _work(gm: torch.fx.GraphModule, sharding: Sharding
          ) -> tuple[dict[str, int], dict[str, list[tuple[GemmCall, frozenset[str], str | None]]]]:
    """Forward and backward device work by region and class (`ModelProfile.work`), split
    as `sharding` says; and per "{region}.{phase}" its GEMMs, each with its node's classes
    and the dimension tensor parallelism divides (`gemm_tiles.split_dim`)."""
    region, sharded = _regions(gm), _tp_sharded(gm, sharding)
    core = {n.name for c in attention_cores(_layer_nodes(gm, region)) for n in c}
    reruns = _reruns(gm, region)
    kv_path = _kv_path(gm, sharding, sharded)
    styles = _styles(gm, sharding)
    split = sharded | {name for name, style in styles.items() if style == ROWWISE}
    whole = _whole_under_sp(gm, sharded)
    out = {f"work.{r}.{ph}.{q}.{c}": 0 for r in WORK_REGIONS for ph in ("fwd", "bwd")
           for q in WORK_QUANTITIES for c in WORK_CLASSES if q not in COUNTS or c == "all"}
    out.update({f"work.{rerun_region(p)}.fwd.{q}.{c}": 0 for p in reruns
                for q in WORK_QUANTITIES for c in WORK_CLASSES if q not in COUNTS or c == "all"})
    gemms: dict[str, list[tuple[GemmCall, frozenset[str], str | None]]] = {}
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, node_work in graph_work(gm, _inputs(gm)).items():
        r = region.get(name, "post")
        if r == "later":
            continue
        targets = (r, "core") if r == "layer" and name in core else (r,)
        classes = ("all", *(("tp",) if name in split else ()),
                   *(("kv",) if name in kv_path else ()), *(("whole",) if name in whole else ()))
        reran = [rerun_region(p) for p, names in reruns.items() if name in names]
        split_by = _split_weight(gm, nodes[name], styles.get(name)) if name in nodes \
            else (None, None, None)
        for ph, w, calls in (("fwd", node_work.forward, node_work.forward_gemms),
                             ("bwd", node_work.backward, node_work.backward_gemms)):
            values = {"gemm": w.gemm, "attn": w.attention, "mem": w.memory,
                      "fmem": w.fused_memory, "ops": w.ops, "kern": w.kernels}
            shaped = [(call, frozenset(classes) - {"all"}, split_dim(call, *split_by))
                      for call in calls]
            for target in (*targets, *(reran if ph == "fwd" else ())):
                for q, value in values.items():
                    for c in classes if q not in COUNTS else ("all",):
                        out[f"work.{target}.{ph}.{q}.{c}"] += int(value)
                gemms.setdefault(f"{target}.{ph}", []).extend(shaped)
    return out, gemms


def _split_weight(gm: torch.fx.GraphModule, node: torch.fx.Node, style: str | None
                  ) -> tuple[str | None, int | None, tuple[int, ...] | None]:
    """(weight name, the dimension of it tensor parallelism splits, its shape) of a linear
    that `style` splits; Nones for any other node (`gemm_tiles.split_dim`)."""
    weight = linear_weight(node)
    out_dim = linear_out_dim(node) if weight else None
    if style not in (COLWISE, ROWWISE, VOCAB) or out_dim is None:
        return None, None, None
    try:
        shape = tuple(gm.get_parameter(weight).shape)
    except AttributeError:
        return None, None, None
    return weight, out_dim if style != ROWWISE else 1 - out_dim, shape


def _fit_gemms(points: list[tuple[int, int]], samples: dict[tuple[int, int], dict[str, list]]
               ) -> tuple[dict[str, tuple[GemmShape, ...]], dict[str, tuple[GemmShape, ...]]]:
    """`ModelProfile.gemms` and `gemms_b1`: each region's phase's GEMM shapes fitted on the
    points `_fit_work` fits (`gemm_tiles.fit_shapes`)."""
    grids = ((points, True), (_work_points(points), False))
    out: tuple[dict, dict] = ({}, {})
    for (grid, with_batch), fitted in zip(grids, out):
        for key in samples[grid[0]]:
            if all(key in samples[pt] for pt in grid):
                shapes = fit_shapes({pt: samples[pt][key] for pt in grid}, grid,
                                    with_batch=with_batch)
                if shapes is not None:
                    fitted[key] = shapes
    return out


def rerun_region(policy: str) -> str:
    """The `ModelProfile.work` region of what recomputing one layer under `policy` (one of
    EXTRA_POLICIES) reruns, forward only."""
    return f"rerun[{policy}]"


def _with_fp8_copies(storage, fp8_linears: set[str], savers=None) -> int:
    """Bytes a saved storage costs when kept by `savers` (all its savers when None; a
    storage nothing saves is held as a checkpoint's input, whole), each float8 GEMM among
    them keeping its own float8 copy of it instead (`_kept_as`)."""
    if savers is None and not storage.savers:
        return storage.nbytes
    whole, copies = _kept_as(storage, fp8_linears, storage.savers if savers is None else savers)
    return storage.nbytes * whole + copies


FP8_SCALE_BYTES = 8
"""What a float8 linear saves beside its input's copy: the input's and the weight's scales,
one fp32 each (`ptc.ops.fp8_linear`)."""


def _kept_as(storage, fp8_linears: set[str], savers) -> tuple[bool, int]:
    """(whether the storage itself is kept, bytes of float8 copies kept of it) when
    `savers` keep it: each float8 GEMM (`ptc.ops.fp8_linear`) keeps its own copy, one
    byte an element of the bf16 storage, and its scales; the storage itself stays when
    another saver keeps it or it is held (the next layer's input)."""
    users = [x for x in savers if x in fp8_linears]
    whole = bool(savers) and (len(users) < len(savers) or storage.held)
    return whole, len(users) * (storage.nbytes // 2 + FP8_SCALE_BYTES)


def _boundaries(gm: torch.fx.GraphModule, region: dict[str, str]) -> set[str]:
    """Nodes whose outputs cross layer 0's boundaries, as a fully recomputed layer's
    checkpoint holds them: what layer 0 reads from before it (its input) and its nodes
    read after it (its output, the next layer's input). Model state is not among them."""
    crossing = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            continue
        inside = region[n.name] == "layer"
        if any((region[u.name] == "layer") != inside for u in n.users):
            crossing.add(n.name)
    return crossing


def _placeholders(gm: torch.fx.GraphModule) -> set[str]:
    return {n.name for n in gm.graph.nodes if n.op == "placeholder"}


def _param_groups(gm: torch.fx.GraphModule,
                  sharding: Sharding) -> tuple[dict[str, ParamGroups], int]:
    """Parameter elements per region ("layer": layer 0's), split or replicated as tensor
    parallelism splits them, and the elements of a head tied to the embedding."""
    region = _regions(gm)
    readers: dict[str, list[str]] = {}  # parameter name -> regions of the nodes reading it
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            readers.setdefault(str(n.target), []).extend(region[u.name] for u in n.users)
        elif n.op == "call_module":
            for leaf, _ in gm.get_submodule(str(n.target)).named_parameters():
                readers.setdefault(f"{n.target}.{leaf}", []).append(region[n.name])
    by_id: dict[int, list[str]] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    order = ("pre", "layer", "later", "post")
    groups = {r: [0, 0, 0, 0] for r in ("pre", "layer", "post")}
    tied_elements = 0
    for names in by_id.values():
        found = [r for name in names for r in readers.get(name, [])]
        if not found:
            continue
        where = min(found, key=order.index)
        if where == "later":
            continue
        numel = gm.get_parameter(names[0]).numel()
        if len(names) > 1 and len({r for r in found}) > 1:
            tied_elements = numel  # a head tied to the embedding: counted with the embedding
        # by module path, or by the parameter's own name (a stack of expert weights)
        styles = {sharding.styles.get(name, sharding.styles.get(name.rpartition(".")[0]))
                  for name in names}
        split = bool(styles & {COLWISE, VOCAB}) or (
            ROWWISE in styles and names[0].endswith("weight"))
        g = groups[where]
        g[0 if split else 1] += numel
        g[2] += 1
        if split and any(name.rpartition(".")[0] in sharding.kv_projections
                         for name in names):
            g[3] += numel
    return {r: ParamGroups(*g) for r, g in groups.items()}, tied_elements
