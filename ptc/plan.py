"""The plan: frozen dataclasses that say everything one training run needs.

A `Plan` has five sections — model, hardware, parallel, train, runtime — each
a frozen dataclass that validates its own fields and names the field when one
is wrong. `Plan` itself checks the rules that tie sections together (tp·pp·dp
equals the GPUs, heads divisible by tp, ...) in `ptc.checks`. Plans parsed
from a file keep, per section, a `spans` mapping from field name to the
place in the file, so every error can point at line and column.

Terms: an *axis* is a mesh axis (tp, pp, dp); a *dim* is a tensor dimension.
All quantities are in base units: bytes, bytes/s, FLOP/s, seconds.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ptc.errors import DiagnosticSink, Span, did_you_mean
from ptc.presets import PCIE4_X16, PRESETS, sustained_clock_share

Auto = Literal["auto"]
AUTO: Auto = "auto"

FAMILIES = ("gpt", "llama", "custom")
NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "relu", "swiglu")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "zbv", "dualpipev")
SPLIT_BACKWARD = ("zero_bubble", "zbv", "dualpipev")
"""Schedules that run each backward in two: I (input gradients), then W (weight gradients)."""
V_SHAPED = ("zbv", "dualpipev")
"""Schedules that place a rank's two stages in a V: rank r holds stages r and 2p - 1 - r."""
CHECKPOINT_POLICIES = ("none", "full", "selective", "ops", "auto")
LAYER_CHECKPOINT_POLICIES = ("none", "full", "selective", "ops")
AUTO_CHOICES = ("all",)
"""What `checkpoint = auto(...)` may choose from besides auto's none / selective / full:
`all`, every policy (op-level and module recompute too)."""
AUTO_CHECKPOINTS = ("auto", "auto(all)")
"""The checkpoint values the compiler resolves per stage: "auto" (none, selective, full) and
"auto(all)" (every policy a layer can take)."""
RECOMPUTE_MODULES = ("core_attn", "mlp", "norm", "act")
"""Parts of a layer `modules(...)` recomputes: the attention core, the MLP, the norms, the
activation function (in this order in a policy's name)."""
SHARD_STYLES = ("colwise", "rowwise", "replicate", "vocab")
AXES = ("tp", "cp", "dp", "pp")
DTYPES = ("fp32", "bf16", "fp16", "fp8")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes of an element kept in a dtype (fp8 is no storage dtype: its plans keep bf16)."""
FP8_SCALINGS = ("current", "delayed")
FP8_RECIPES = ("tensorwise", "rowwise", "mxfp8")
"""`train.fp8_recipe`: how finely float8 GEMM operands are scaled (`ptc.ops.fp8_linear`)."""
GRAD_COMMS = ("none", "fp8", "fp8_e5m2")
TP_COMMS = ("sync", "async")
"""`parallel.tp_comm`: sequence parallelism's collectives whole, or in ring steps."""
GPU_RUNTIME_RESERVE = 1 << 30
"""Bytes a GPU rank's runtime holds beside the model: CUDA context, cuBLAS and NCCL
workspaces."""
CPU_PROCESS_BYTES = 245 << 20
"""Resident bytes of a CPU rank before its model: the interpreter, torch, gloo and ptc's
compiler and runtime (a rank forked by `run_local` that joined a gloo group and ran one
all-reduce measured 245 MiB, Python 3.11, torch 2.13)."""
OFFLOADS = ("none", "optimizer")
OPTIMIZERS = ("adamw", "sgd")
LR_SCHEDULES = ("constant", "cosine", "linear")
DATA_KINDS = ("synthetic", "uniform", "tokens")
TOKEN_DTYPES = ("uint16", "uint32")
INIT_KINDS = ("random", "state_dict", "hf")
BACKENDS = ("auto", "nccl", "gloo")
DROP_POLICIES = ("probs", "position")
"""`moe.drop_policy`: which of an expert's rows over its capacity are dropped."""
NAN_POLICIES = ("stop", "skip", "rollback")


def modules_policy(modules) -> str:
    """The policy recomputing `modules` (names of RECOMPUTE_MODULES), as plans write it:
    `modules(core_attn, mlp)`, the names in RECOMPUTE_MODULES' order; the attention core
    alone is "selective"."""
    chosen = [m for m in RECOMPUTE_MODULES if m in set(modules)]
    if chosen == ["core_attn"]:
        return "selective"
    return f"modules({', '.join(chosen)})"


def policy_modules(policy: str) -> frozenset[str] | None:
    """The modules a `modules(...)` policy (or "selective") recomputes; None for any other
    policy or a malformed one."""
    if policy == "selective":
        return frozenset({"core_attn"})
    if not isinstance(policy, str) or not (policy.startswith("modules(")
                                           and policy.endswith(")")):
        return None
    names = [n.strip() for n in policy[len("modules("):-1].split(",")]
    if not names or any(n not in RECOMPUTE_MODULES for n in names):
        return None
    return frozenset(names)


def module_policy(policy: str) -> str | None:
    """`policy` written canonically when it is a `modules(...)` policy, else None."""
    if not isinstance(policy, str) or not policy.startswith("modules("):
        return None
    modules = policy_modules(policy)
    return modules_policy(modules) if modules else None


def is_auto_checkpoint(checkpoint) -> bool:
    """Whether the compiler chooses the policies (`AUTO_CHECKPOINTS`)."""
    return isinstance(checkpoint, str) and checkpoint in AUTO_CHECKPOINTS


def is_layer_policy(policy) -> bool:
    """Whether `policy` is a recompute policy of one layer (a name or `modules(...)`)."""
    return policy in LAYER_CHECKPOINT_POLICIES or module_policy(policy) is not None


def stage_rank(stage: int, pp: int, schedule: str) -> int:
    """The pipeline rank that runs `stage` (0 .. p·v - 1) under `schedule`: rank s % p, a
    loop (Megatron's interleaving: rank r holds stages r, r + p, ...), or for a V-shaped
    schedule (`V_SHAPED`) every other chunk mirrored, so rank r holds stages r and
    2p - 1 - r, the first and the last stage on rank 0. Either way the stage is that
    rank's chunk s // p."""
    chunk, position = divmod(stage, pp)
    return pp - 1 - position if schedule in V_SHAPED and chunk % 2 else position


def _spans() -> Mapping[str, Span]:
    return field(default_factory=dict, compare=False, repr=False)


class _Section:
    """Shared validation plumbing for plan sections (dataclasses with `spans`)."""

    __slots__ = ()
    _path: str = ""

    def _sink(self) -> DiagnosticSink:
        return DiagnosticSink()

    def _bad(self, sink: DiagnosticSink, name: str, message: str,
             choices: tuple[str, ...] = ()) -> None:
        spans = getattr(self, "spans", {}) or {}
        sink.error(message, field=f"{self._path}.{name}" if self._path else name,
                   span=spans.get(name), choices=choices)

    def _choice(self, sink: DiagnosticSink, name: str, choices: tuple[str, ...]) -> None:
        value = getattr(self, name)
        if value not in choices:
            hint = did_you_mean(value, choices) if isinstance(value, str) else ""
            self._bad(sink, name, f"{name} = {value!r} is not one of the valid choices{hint}",
                      choices)

    def _int(self, sink: DiagnosticSink, name: str, *, minimum: int = 1,
             allow_auto: bool = False, allow_none: bool = False) -> None:
        value = getattr(self, name)
        if value is None and allow_none:
            return
        if allow_auto and value == AUTO:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            what = "an integer" + (" or auto" if allow_auto else "")
            self._bad(sink, name, f"{name} must be {what}, got {value!r}")
        elif value < minimum:
            self._bad(sink, name, f"{name} must be >= {minimum}, got {value}")

    def _number(self, sink: DiagnosticSink, name: str, *, minimum: float = 0.0,
                strict: bool = False, allow_none: bool = False) -> None:
        value = getattr(self, name)
        if value is None and allow_none:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self._bad(sink, name, f"{name} must be a number, got {value!r}")
        elif isinstance(value, float) and not math.isfinite(value):
            # NaN compares False with every bound, so it would pass silently.
            self._bad(sink, name, f"{name} must be finite, got {value!r}")
        elif value < minimum or (strict and value == minimum):
            bound = ">" if strict else ">="
            self._bad(sink, name, f"{name} must be {bound} {minimum:g}, got {value:g}")

    def _bool(self, sink: DiagnosticSink, name: str) -> None:
        if not isinstance(getattr(self, name), bool):
            self._bad(sink, name, f"{name} must be true or false, got {getattr(self, name)!r}")


# --------------------------------------------------------------------- model


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec(_Section):
    """Which model to train: a built-in family with its shape, or a user factory."""

    _path = "model"
    family: str
    """"gpt", "llama", or "custom" (a user factory)."""
    layers: int | None = None
    """Number of transformer layers."""
    hidden: int | None = None
    """Hidden size h."""
    heads: int | None = None
    """Attention heads a."""
    kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means equal to heads."""
    ffn: int | None = None
    """MLP inner size; None means 4·h for gpt. Required for llama."""
    vocab: int | None = None
    """Vocabulary size V."""
    max_seq: int | None = None
    """Longest sequence the model accepts (learned positions / RoPE table)."""
    norm: str | None = None
    """"layernorm" or "rmsnorm"; family default when None."""
    activation: str | None = None
    """"gelu", "relu" or "swiglu"; family default when None."""
    tied_embeddings: bool | None = None
    """Share the input embedding with the LM head; family default when None."""
    bias: bool | None = None
    """Biases in linear layers (gpt default true, llama false)."""
    dropout: float = 0.0
    """Dropout probability (gpt only)."""
    rope_theta: float = 10000.0
    """RoPE base (llama only)."""
    norm_eps: float = 1e-5
    """Epsilon of the norms."""
    factory: str | None = None
    """For family "custom": "package.module:callable" returning an nn.Module."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the factory."""
    spans: Mapping[str, Span] = _spans()
    """Field name -> place in the plan file."""

    def __post_init__(self) -> None:
        sink = self._sink()
        self._choice(sink, "family", FAMILIES)
        if self.family == "custom":
            if not isinstance(self.factory, str) or ":" not in self.factory:
                self._bad(sink, "factory",
                          f"a user model is given as \"package.module:callable\", got {self.factory!r}")
        elif self.family in FAMILIES:
            for name in ("layers", "hidden", "heads", "vocab", "max_seq"):
                self._int(sink, name)
            self._int(sink, "kv_heads", allow_none=True)
            self._int(sink, "ffn", allow_none=True)
            if self.family == "llama" and self.ffn is None:
                self._bad(sink, "ffn", "llama needs ffn (the SwiGLU inner size), e.g. ffn = 28672")
            if self.norm is not None:
                self._choice(sink, "norm", NORMS)
            if self.activation is not None:
                self._choice(sink, "activation", ACTIVATIONS)
            for name in ("tied_embeddings", "bias"):
                if getattr(self, name) is not None:
                    self._bool(sink, name)
            self._number(sink, "dropout")
            if isinstance(self.dropout, (int, float)) and self.dropout >= 1:
                self._bad(sink, "dropout", f"dropout must be < 1, got {self.dropout:g}")
            self._number(sink, "rope_theta", strict=True)
            self._number(sink, "norm_eps", strict=True)
            if self.family == "gpt" and self.activation == "swiglu":
                self._bad(sink, "activation", "gpt uses gelu or relu; swiglu is llama's",
                          ("gelu", "relu"))
        sink.raise_if_errors()

    @property
    def num_kv_heads(self) -> int | None:
        """kv_heads, defaulting to heads."""
        return self.kv_heads if self.kv_heads is not None else self.heads

    def kv_heads_fit(self, tp: int) -> bool:
        """Whether tensor parallelism of degree `tp` can share the key/value heads: split
        them (tp divides them) or replicate them (they divide tp; gpt's fused qkv cannot)."""
        kv = self.num_kv_heads
        return kv % tp == 0 or (tp % kv == 0 and self.family != "gpt")

    @property
    def ffn_size(self) -> int | None:
        """ffn, defaulting to 4·hidden."""
        if self.ffn is not None:
            return self.ffn
        return 4 * self.hidden if self.hidden is not None else None


# ------------------------------------------------------------------ hardware


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSpec(_Section):
    """One kind of link between GPUs (NVLink inside a node, InfiniBand across)."""

    _path = "hardware.link"
    bandwidth: float
    """Per-GPU, per-direction bandwidth, bytes/s."""
    latency: float
    """Latency of one transfer, seconds."""
    spans: Mapping[str, Span] = _spans()
    """Field name -> place in the plan file."""

    def __post_init__(self) -> None:
        sink = self._sink()
        self._number(sink, "bandwidth", strict=True)
        self._number(sink, "latency")
        sink.raise_if_errors()


@dataclass(frozen=True, slots=True, kw_only=True)
class HardwareSpec(_Section):
    """The machines: accelerator figures, how many, and how they are linked."""

    _path = "hardware"
    gpu: str
    """Preset name (see `ptc.presets.PRESETS`) or "custom"."""
    nodes: int = 1
    """Number of nodes."""
    gpus_per_node: int = 8
    """Accelerators per node."""
    hbm_bytes: float
    """Memory per accelerator, bytes."""
    peak_flops: Mapping[str, float]
    """Dense peak FLOP/s per compute dtype."""
    mem_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    intra: LinkSpec
    """Link between accelerators of one node."""
    inter: LinkSpec
    """Link between nodes (per accelerator)."""
    nvlink_sharp: bool = False
    """Whether the intra-node switch reduces in the network (NVLS)."""
    achievable_fraction: float = 0.5
    """Share of the dense peak a matrix product (GEMM) reaches (cost model)."""
    attention_fraction: float | None = None
    """Share of the dense peak the matrix products of a fused attention kernel reach (cost
    model); None: the GEMMs' rate, as cuDNN's and FlashAttention-3's kernels run on Hopper.
    FlashAttention-2's (SDPA's flash backend) runs at about half of it there
    (docs/cost-model.md, "Attention kernels")."""
    host_bandwidth: float = PCIE4_X16
    """Per-accelerator, per-direction bandwidth of its link to host memory (PCIe), bytes/s:
    what optimizer offload's copies move at (default PCIe Gen4 x16)."""
    host_memory_bytes: float = 2 * 10**12
    """Host memory per node, bytes: where in-memory snapshots live (`runtime.snapshot_every`),
    half of it as tmpfs by default."""
    memory_margin: float = 0.0
    """Bytes of each accelerator's memory kept out of the budget (CUDA context, communication
    buffers, fragmentation): plans must fit in hbm_bytes - memory_margin."""
    gemm_flops: Mapping[str, float] = field(default_factory=dict)
    """Measured FLOP/s of matrix products per compute dtype (a calibration); a dtype not
    given is priced at peak_flops x achievable_fraction."""
    dispatch_overhead: float = 0.0
    """Seconds the host spends dispatching one op (cost model): added to each op on a
    CPU, where the host runs the kernels itself; on a GPU, which runs kernels while the
    host queues more, the larger of it and the kernels' time counts."""
    multiprocessors: int = 0
    """Streaming multiprocessors per GPU (cost model): GEMMs are priced at their shape's
    tile and wave efficiency (`ptc.compiler.graph.gemm_tiles`); 0 prices them by FLOPs alone."""
    comm_multiprocessors: int = 0
    """Streaming multiprocessors a running collective's kernels hold (NCCL's thread blocks,
    one per channel; cost model): compute beside a hidden collective runs on the others, so
    each second of communication hidden behind compute adds comm_multiprocessors /
    multiprocessors of a second (`StepCost` part "contention"); 0 adds none, as does a GPU
    of `multiprocessors` 0."""
    board_power: float = 0.0
    """Board power (TDP) per accelerator, watts: the power limit its rates hold at (the
    preset's; 0 when unknown, and for the CPU, which has no limit to cap)."""
    min_power_limit: float = 0.0
    """The lowest power limit the accelerator accepts (nvidia-smi's "Min Power Limit"), watts."""
    power_limit: float | None = None
    """The power limit each accelerator runs under, watts, when below board power: matrix
    products not measured (`gemm_flops`) are priced at the clock it sustains
    (`ptc.presets.sustained_clock_share`); None runs at board power."""
    profile: str | None = None
    """The calibration file (`ptc calibrate`) whose figures this hardware carries, if any."""
    spans: Mapping[str, Span] = _spans()
    """Field name -> place in the plan file."""

    @classmethod
    def preset(cls, gpu: str, *, nodes: int = 1, gpus_per_node: int | None = None,
               **overrides: Any) -> HardwareSpec:
        """Hardware from a preset name, with any field overridden; `profile="hw.json"` takes
        the figures of that calibration file (`ptc.hwprofile`) first, the other overrides
        after it (a bad file raises `ptc.hwprofile.ProfileError`)."""
        from ptc.errors import PlanError  # noqa: PLC0415 - avoid a cycle at import

        if gpu not in PRESETS:
            sink = DiagnosticSink()
            sink.error(f"unknown gpu {gpu!r}", field="hardware.gpu",
                       span=overrides.get("spans", {}).get("gpu"), choices=tuple(PRESETS))
            raise PlanError(sink.errors)
        p = PRESETS[gpu]
        values: dict[str, Any] = dict(
            gpu=gpu, nodes=nodes,
            gpus_per_node=gpus_per_node if gpus_per_node is not None else p.gpus_per_node,
            hbm_bytes=p.hbm_bytes, peak_flops=dict(p.peak_flops), mem_bandwidth=p.mem_bandwidth,
            intra=LinkSpec(bandwidth=p.intra_bandwidth, latency=p.intra_latency),
            inter=LinkSpec(bandwidth=p.inter_bandwidth, latency=p.inter_latency),
            nvlink_sharp=p.nvlink_sharp, achievable_fraction=p.achievable_fraction,
            host_bandwidth=p.host_bandwidth, host_memory_bytes=p.host_memory_bytes,
            dispatch_overhead=p.dispatch_overhead,
            multiprocessors=p.multiprocessors, comm_multiprocessors=p.comm_multiprocessors,
            board_power=p.board_power, min_power_limit=p.min_power_limit,
        )
        if overrides.get("profile"):
            values.update(profile_fields(overrides["profile"]))
        values.update(overrides)
        return cls(**values)

    def __post_init__(self) -> None:
        sink = self._sink()
        self._int(sink, "nodes")
        self._int(sink, "gpus_per_node")
        self._number(sink, "hbm_bytes", strict=True)
        self._number(sink, "mem_bandwidth", strict=True)
        self._number(sink, "achievable_fraction", strict=True)
        self._number(sink, "attention_fraction", strict=True, allow_none=True)
        self._number(sink, "memory_margin")
        self._number(sink, "host_bandwidth", strict=True)
        self._number(sink, "host_memory_bytes", strict=True)
        self._number(sink, "dispatch_overhead")
        self._int(sink, "multiprocessors", minimum=0)
        self._int(sink, "comm_multiprocessors", minimum=0)
        if isinstance(self.comm_multiprocessors, int) and isinstance(self.multiprocessors, int) \
                and 0 < self.multiprocessors <= self.comm_multiprocessors:
            self._bad(sink, "comm_multiprocessors",
                      f"comm_multiprocessors ({self.comm_multiprocessors}) must be fewer than "
                      f"the GPU's multiprocessors ({self.multiprocessors})")
        for dtype, value in dict(self.gemm_flops).items():
            if dtype not in DTYPES + ("tf32",):
                self._bad(sink, "gemm_flops", f"unknown compute dtype {dtype!r} in gemm_flops",
                          DTYPES + ("tf32",))
            elif not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                self._bad(sink, "gemm_flops", f"gemm_flops.{dtype} must be > 0, got {value!r}")
        if isinstance(self.memory_margin, (int, float)) and isinstance(self.hbm_bytes, (int, float)) \
                and 0 < self.hbm_bytes <= self.memory_margin:
            self._bad(sink, "memory_margin", f"memory_margin ({self.memory_margin:g} bytes) leaves "
                      f"no memory: it must be below hbm ({self.hbm_bytes:g} bytes)")
        for name in ("achievable_fraction", "attention_fraction"):
            share = getattr(self, name)
            if isinstance(share, (int, float)) and share > 1:
                self._bad(sink, name, f"{name} is a share of peak (0, 1], got {share:g}")
        if not self.peak_flops:
            self._bad(sink, "peak_flops", "peak_flops needs at least one dtype, e.g. bf16 = 989 TFLOP/s")
        for dtype, value in dict(self.peak_flops).items():
            if dtype not in DTYPES + ("tf32", "fp8"):
                self._bad(sink, "peak_flops", f"unknown compute dtype {dtype!r} in peak_flops",
                          DTYPES + ("tf32", "fp8"))
            elif not isinstance(value, (int, float)) or value <= 0:
                self._bad(sink, "peak_flops", f"peak_flops.{dtype} must be > 0, got {value!r}")
        before = len(sink.errors)
        self._number(sink, "board_power")
        self._number(sink, "min_power_limit")
        self._number(sink, "power_limit", strict=True, allow_none=True)
        if len(sink.errors) == before:
            self._check_power_limit(sink)
        sink.raise_if_errors()

    def _check_power_limit(self, sink: DiagnosticSink) -> None:
        """A power limit needs a part that has one, and must lie in the part's range."""
        if self.min_power_limit > self.board_power:
            self._bad(sink, "min_power_limit", f"min_power_limit ({self.min_power_limit:g} W) "
                      f"must not exceed board_power ({self.board_power:g} W)")
        elif self.power_limit is None:
            return
        elif self.synchronous:
            self._bad(sink, "power_limit", "power_limit caps a GPU's power; a CPU has none "
                      "(remove power_limit)")
        elif not self.board_power:
            self._bad(sink, "power_limit", "power_limit needs the part's board_power (its full "
                      "power, e.g. board_power = 700 W) to price the cap against")
        elif not self.min_power_limit <= self.power_limit <= self.board_power:
            self._bad(sink, "power_limit", f"power_limit = {self.power_limit:g} W is outside "
                      f"{self.gpu}'s range, {self.min_power_limit:g} W to {self.board_power:g} W")

    @property
    def num_gpus(self) -> int:
        """nodes · gpus_per_node."""
        return self.nodes * self.gpus_per_node

    @property
    def memory_budget(self) -> float:
        """Bytes a rank's plan may use: hbm_bytes - memory_margin."""
        return self.hbm_bytes - self.memory_margin

    @property
    def runtime_reserve(self) -> float:
        """Bytes a rank holds beside the model, training aside: on a GPU the CUDA context,
        cuBLAS and NCCL workspaces (1 GiB); on a CPU, where a rank's memory is its process's,
        the process itself: the interpreter, torch and gloo (`CPU_PROCESS_BYTES`)."""
        return CPU_PROCESS_BYTES if self.synchronous else GPU_RUNTIME_RESERVE

    @property
    def synchronous(self) -> bool:
        """Whether the host runs the kernels itself (a CPU), rather than queueing them on an
        accelerator that runs them while the host goes on."""
        return self.gpu == "cpu"

    @property
    def contention(self) -> float:
        """Seconds of compute a second of communication hidden behind it adds: the share of
        the SMs its kernels hold (`comm_multiprocessors`)."""
        if self.synchronous or not self.multiprocessors:
            return 0.0
        return self.comm_multiprocessors / self.multiprocessors

    @property
    def clock_share(self) -> float:
        """The share of its full-power clock the part sustains in matrix products under
        power_limit (`ptc.presets.sustained_clock_share`); 1 without a limit."""
        if self.power_limit is None:
            return 1.0
        return sustained_clock_share(self.power_limit, self.board_power)

    def gemm_rate(self, dtype: str) -> float:
        """FLOP/s of matrix products in `dtype`: measured (under the power limit the part ran
        at), else peak x achievable_fraction x clock_share."""
        if dtype in self.gemm_flops:
            return self.gemm_flops[dtype]
        return self.peak_flops[dtype] * self.achievable_fraction * self.clock_share

    def attention_rate(self, dtype: str) -> float:
        """FLOP/s of a fused attention kernel's matrix products in `dtype`: peak x
        attention_fraction x clock_share where attention_fraction is given, else the GEMMs'
        (`gemm_rate`)."""
        if self.attention_fraction is None:
            return self.gemm_rate(dtype)
        return self.peak_flops[dtype] * self.attention_fraction * self.clock_share


def _profiled_imbalance(path: str) -> float | None:
    """The routing imbalance the profile at `path` measured (None: it has none), read once per
    version of the file: the estimate asks for it at every pipeline cut it prices."""
    return _imbalance_of(path, os.stat(path).st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _imbalance_of(path: str, version: int) -> float | None:
    from ptc.hwprofile import load_profile  # noqa: PLC0415 - only plans naming one need it

    routing = load_profile(path).routing
    return None if routing is None else routing.imbalance


def profile_fields(path: str) -> dict[str, Any]:
    """The HardwareSpec fields a calibration file sets (`ptc.hwprofile`)."""
    from ptc.hwprofile import load_profile  # noqa: PLC0415 - only plans naming one need it

    values = load_profile(path).overrides()
    for name in ("intra", "inter"):
        if name in values:
            bandwidth, latency = values[name]
            values[name] = LinkSpec(bandwidth=bandwidth, latency=latency)
    return values


# ------------------------------------------------------------------ parallel


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardRule(_Section):
    """An explicit sharding of the modules whose path matches a glob."""

    _path = "parallel.shard"
    pattern: str
    """fnmatch glob over module paths, e.g. "layers.*.mlp.up"."""
    style: str
    """"colwise", "rowwise", "replicate" or "vocab"."""
    spans: Mapping[str, Span] = _spans()
    """Field name -> place in the plan file."""

    def __post_init__(self) -> None:
        sink = self._sink()
        self._choice(sink, "style", SHARD_STYLES)
        if not isinstance(self.pattern, str) or not self.pattern:
            self._bad(sink, "pattern", "a shard rule needs a non-empty module-path glob")
        sink.raise_if_errors()


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelSpec(_Section):
    """How the work is split: mesh axes, ZeRO, pipeline schedule, recompute, overlap."""

    _path = "parallel"
    tp: int | Auto = 1
    """Tensor-parallel degree, or "auto"."""
    pp: int | Auto = 1
    """Pipeline stages, or "auto"."""
    dp: int | Auto = 1
    """Data-parallel degree, or "auto"."""
    cp: int | Auto = 1
    """Context-parallel degree, or "auto": each sample's sequence is split over cp ranks
    (load-balanced chunks for causal attention; keys and values gathered over cp)."""
    ep: int | Auto = 1
    """Expert-parallel degree, or "auto" (`ptc plan` searches the divisors of dp·cp that
    divide the experts): the routed experts of every mixture-of-experts layer are
    sharded over ep ranks folded from the dp·cp ranks (Megatron-Core's parallel folding),
    which exchange tokens by all-to-all; each expert's gradient is averaged over the
    dp·cp/ep ranks that hold it. 1: every rank holds every expert."""
    zero: int = 0
    """ZeRO stage 0-3."""
    sequence_parallel: bool = False
    """Shard norm/dropout activations along the sequence across tp."""
    tp_comm: str = "sync"
    """How sequence parallelism's collectives run: "sync", each whole (the backward's
    input-gradient reduce-scatter beside the weight gradients); "async", each all-gather
    and reduce-scatter in ring steps beside the GEMMs it feeds (collective matmul:
    Megatron-LM's tp-comm-overlap, PyTorch's async tensor parallelism). "async" needs
    sequence_parallel and overlap."""
    schedule: str = "1f1b"
    """"gpipe", "1f1b", "interleaved", "zero_bubble" (ZB-H1: 1F1B, or interleaved 1F1B
    with virtual_stages >= 2, with each backward split into its input and weight gradients,
    the latter filling the bubble) or "zbv" (ZB-V: two chunks per rank placed in a V, rank
    r holding stages r and 2p - 1 - r, each backward split as zero_bubble's; virtual_stages
    is 2) or "dualpipev" (DeepSeek-V3's DualPipeV on the same V: one micro-batch's forward
    beside another's backward, run one after the other by ptc's one-stream runtime;
    at least 2p micro-batches)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved, zero_bubble, zbv or dualpipev), v."""
    microbatches: int | None = None
    """Micro-batches per step per pipeline; None: global_batch / (micro_batch·dp)."""
    checkpoint: str | tuple[str, ...] = "none"
    """"none", "full", "selective", "ops", "modules(core_attn, mlp)" (any of
    RECOMPUTE_MODULES), "auto" (the compiler picks among none, selective and full),
    "auto(all)" (among every policy), or one of these but the auto ones per layer (see
    `module_policy` for how a module set is written)."""
    overlap: bool = True
    """Overlap communication with compute."""
    grad_comm: str = "none"
    """How gradients travel in the data-parallel reduction (ZeRO 0-2): "none" as they are
    kept (train.grad_dtype); "fp8" (e4m3) or "fp8_e5m2" quantised with one scale per bucket
    and rank, summed in fp32 on arrival: half the bytes of bf16, and other numbers (opt-in)."""
    offload: str = "none"
    """What lives in host memory instead of the device: "none", or "optimizer" — the fp32
    masters and optimizer state, stepped on the CPU (ZeRO 1-3; ptc.runtime.offload)."""
    bucket_size: float | Auto = "auto"
    """Bytes per communication bucket: small per-unit collectives (ZeRO-3 gathers, gradient
    reductions) are merged up to this size; "auto" derives it from the link and the model
    (see ptc.passes.overlap_collectives)."""
    order: tuple[str, ...] = ("tp", "cp", "dp", "pp")
    """Mesh axes from innermost (fastest-varying rank) to outermost; an order that leaves
    out cp puts it just outside tp."""
    stage_boundaries: tuple[str | None, ...] = ()
    """Pinned pipeline cuts: the graph piece ("layers.20", "norm", ...) where each of
    stages 1 .. pp·v-1 starts; None leaves that cut to the cost model; () pins none."""
    first_stage_layers: int | None = None
    """Layers of pipeline stage 0 (the one with the embedding); None: as the others. With
    `last_stage_layers`, an uneven split (Megatron-LM's --decoder-first-pipeline-num-layers):
    the other stages share the remaining layers evenly (see `stage_layers`)."""
    last_stage_layers: int | None = None
    """Layers of the last pipeline stage (the one with the head and the loss); None: as the
    others (Megatron-LM's --decoder-last-pipeline-num-layers)."""
    shards: tuple[ShardRule, ...] = ()
    """Explicit shard annotations that override what the compiler infers."""
    spans: Mapping[str, Span] = _spans()
    """Field name -> place in the plan file."""

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule runs each backward as I then W (`SPLIT_BACKWARD`)."""
        return self.schedule in SPLIT_BACKWARD

    @property
    def v_shaped(self) -> bool:
        """Whether the schedule places a rank's chunks in a V (`V_SHAPED`, `stage_rank`)."""
        return self.schedule in V_SHAPED

    def __post_init__(self) -> None:
        sink = self._sink()
        for axis in AXES:
            self._int(sink, axis, allow_auto=True)
        if not isinstance(self.zero, int) or isinstance(self.zero, bool) or not 0 <= self.zero <= 3:
            self._bad(sink, "zero", f"zero must be a stage 0-3, got {self.zero!r}",
                      ("0", "1", "2", "3"))
        self._int(sink, "ep", allow_auto=True)
        self._bool(sink, "sequence_parallel")
        self._bool(sink, "overlap")
        self._choice(sink, "tp_comm", TP_COMMS)
        self._choice(sink, "grad_comm", GRAD_COMMS)
        self._choice(sink, "offload", OFFLOADS)
        if self.offload != "none" and self.zero == 0:
            self._bad(sink, "offload", f"offload = {self.offload} needs zero 1-3: each rank "
                      f"offloads the shard of the optimizer it owns, got zero = 0", ("none",))
        if self.bucket_size != "auto":
            self._number(sink, "bucket_size", strict=True)
        self._choice(sink, "schedule", SCHEDULES)
        self._int(sink, "virtual_stages")
        self._int(sink, "microbatches", allow_none=True)
        self._int(sink, "first_stage_layers", allow_none=True)
        self._int(sink, "last_stage_layers", allow_none=True)
        if self.schedule == "interleaved" and isinstance(self.virtual_stages, int) \
                and self.virtual_stages < 2:
            self._bad(sink, "virtual_stages",
                      f"the interleaved schedule needs virtual_stages >= 2, got {self.virtual_stages}")
        if self.schedule in V_SHAPED and self.virtual_stages == 1:  # a V is two chunks
            object.__setattr__(self, "virtual_stages", 2)
        if self.schedule in V_SHAPED and self.virtual_stages != 2:
            self._bad(sink, "virtual_stages", f"schedule {self.schedule} places two chunks per "
                      f"rank in a V: virtual_stages must be 2, got {self.virtual_stages}", ("2",))
        if self.schedule in ("gpipe", "1f1b") and self.virtual_stages != 1:
            self._bad(sink, "virtual_stages",
                      f"virtual_stages = {self.virtual_stages} needs schedule = interleaved")
        if isinstance(self.checkpoint, str) and module_policy(self.checkpoint) is not None:
            object.__setattr__(self, "checkpoint", module_policy(self.checkpoint))
        elif isinstance(self.checkpoint, str):
            if not is_auto_checkpoint(self.checkpoint):
                self._choice(sink, "checkpoint", CHECKPOINT_POLICIES)
        elif isinstance(self.checkpoint, tuple):
            # repr() keeps the sort total when entries are not all strings.
            bad = sorted({repr(c) for c in self.checkpoint if not is_layer_policy(c)})
            if bad or not self.checkpoint:
                self._bad(sink, "checkpoint",
                          f"per-layer checkpoint entries must be none/full/selective/ops or "
                          f"modules(...), got {', '.join(bad)}",
                          LAYER_CHECKPOINT_POLICIES)
            else:
                object.__setattr__(self, "checkpoint", tuple(
                    module_policy(c) or c for c in self.checkpoint))
        else:
            self._bad(sink, "checkpoint", f"checkpoint must be a policy or a per-layer list, "
                      f"got {self.checkpoint!r}", CHECKPOINT_POLICIES)
        if isinstance(self.order, (tuple, list)) and "cp" not in self.order and "tp" in self.order:
            order = list(self.order)
            order.insert(order.index("tp") + 1, "cp")
            object.__setattr__(self, "order", tuple(order))
        if not isinstance(self.order, (tuple, list)) or \
                sorted(map(str, self.order)) != sorted(AXES) or \
                not all(isinstance(a, str) for a in self.order):
            self._bad(sink, "order", f"order must name each of tp, cp, dp, pp once (cp may be "
                      f"left out), got {self.order}")
        sink.raise_if_errors()

    def degree(self, axis: str) -> int | Auto:
        """The degree of a mesh axis."""
        return getattr(self, axis)

    @property
    def pins_layers(self) -> bool:
        """Whether the plan places pipeline cuts: first/last_stage_layers or stage_boundaries."""
        return (self.first_stage_layers is not None or self.last_stage_layers is not None
                or any(b is not None for b in self.stage_boundaries))

    def stage_layers(self, layers: int, sink: DiagnosticSink | None = None
                     ) -> tuple[int, ...] | None:
        """Layers each of the pp·v pipeline stages holds, stage 0 first (resolved pp only).

        `first_stage_layers` / `last_stage_layers` fix what the first and last
        pipeline rank hold, as Megatron-LM's `--decoder-first/last-pipeline-num-layers`
        do: under interleaving that rank's v stages share its count, the first rank's
        shorter stages first and the last rank's last, and one of them may hold no
        layer (only the embedding, or only the head and the loss: Megatron-LM's
        `--account-for-embedding/loss-in-pipeline-split`). Else the cuts
        `stage_boundaries` pins at a layer ("layers.20": stage k starts at layer 20)
        fix theirs. Layers not fixed are shared evenly by the stages left, the later
        ones taking one more when they do not divide; each of them holds at least
        one layer. A problem is recorded in `sink` (and
        None returned), or raised as a PlanError.
        """
        own = sink is None
        sink = self._sink() if own else sink
        given = {name: n for name, n in (("first_stage_layers", self.first_stage_layers),
                                         ("last_stage_layers", self.last_stage_layers))
                 if n is not None}
        counts = self._split_ends(sink, layers, given) if given else \
            self._split_at_boundaries(sink, layers)
        if own:
            sink.raise_if_errors()
        return counts

    def _split_ends(self, sink: DiagnosticSink, layers: int, given: dict[str, int]
                    ) -> tuple[int, ...] | None:
        """Per stage layers of first/last_stage_layers (see `stage_layers`)."""
        pp, v = self.pp, self.virtual_stages
        name = next(iter(given))
        said = " + ".join(f"{n}({c})" for n, c in given.items())
        rest = layers - sum(given.values())
        ranks = {"first_stage_layers": 0, "last_stage_layers": pp - 1}
        others = pp - len(given)
        if pp < 2:
            self._bad(sink, name, f"{name} needs a pipeline; pp({pp})")
            return None
        if self.schedule in V_SHAPED:
            self._bad(sink, name, f"{name} splits the first and the last rank's layers; "
                      f"schedule {self.schedule} puts the first and the last stage on one rank: "
                      f"pin the cuts with stage_boundaries")
            return None
        if others == 0 and rest != 0:
            self._bad(sink, name, f"{said} = {layers - rest} != layers({layers}): with pp({pp}) the "
                      f"first and last rank hold every layer")
            return None
        for end, count in given.items():
            if count < v - 1:
                self._bad(sink, end, f"{end}({count}) leaves {v - count} of that rank's "
                          f"virtual_stages({v}) without a layer; at most its "
                          f"{'first' if end.startswith('first') else 'last'} may hold none")
                return None
        if rest < others * v:
            self._bad(sink, name, f"{said} leave {rest} of layers({layers}) for the other "
                      f"{others * v} of pp({pp}) * virtual_stages({v}) = {pp * v} stages; "
                      f"each stage needs at least one layer")
            return None
        counts = [0] * (pp * v)
        fixed = {ranks[end]: count for end, count in given.items()}
        for rank, count in fixed.items():
            chunks = [rank + j * pp for j in range(v)]
            # The first rank's short stages come first (beside the embedding), the last
            # rank's last (beside the loss), as Megatron-LM's account-for-embedding/loss split.
            _share(counts, chunks if rank == 0 else chunks[::-1], count)
        if others:
            _share(counts, [c for c in range(pp * v) if c % pp not in fixed], rest)
        return tuple(counts)

    def _split_at_boundaries(self, sink: DiagnosticSink, layers: int
                             ) -> tuple[int, ...] | None:
        """Per stage layers of the cuts `stage_boundaries` pins at layers (`stage_layers`)."""
        stages = self.pp * self.virtual_stages
        shape = f"pp({self.pp}) * virtual_stages({self.virtual_stages}) = {stages} stages"
        starts = {0: 0, stages: layers}  # stage -> its first layer ("stage" `stages`: the end)
        for stage, cut in enumerate(self.stage_boundaries, start=1):
            if cut is None:
                continue
            index = _layer_index(cut)
            if index is None or not 0 < index < layers:
                why = "names no layer" if index is None else f"is not inside layers({layers})"
                self._bad(sink, "stage_boundaries", f"stage_boundaries: cut {cut!r} (stage "
                          f"{stage}) {why}; the cost model prices stages by their layers")
                return None
            starts[stage] = index
        if not _each_stage_has_layers(starts):
            self._bad(sink, "stage_boundaries", f"stage_boundaries {list(self.stage_boundaries)}"
                      f" leave a stage of {shape} without a layer of layers({layers})")
            return None
        pinned = sorted(starts.items())
        counts: list[int] = []
        for (s0, l0), (s1, l1) in zip(pinned, pinned[1:]):
            base, extra = divmod(l1 - l0, s1 - s0)
            counts += [base + (i >= s1 - s0 - extra) for i in range(s1 - s0)]
        return tuple(counts)


def _share(counts: list[int], stages: list[int], layers: int) -> None:
    """Give `stages` `layers` evenly, those listed last taking one more where uneven."""
    base, extra = divmod(layers, len(stages))
    for i, stage in enumerate(stages):
        counts[stage] = base + (i >= len(stages) - extra)


# --------------------------------------------------------------------- train


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerSpec(_Section):
    """The optimizer and its hyper-parameters."""

    _path = "train.optimizer"
    name: str = "adamw"
    """"adamw" or "sgd"."""
    lr: float = 3e-4
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    momentum: float = 0.0
    """SGD momentum."""
    spans: Mapping[str, Span] = _spans()
    """Field name -> place in the plan file."""

    def __post_init__(self) -> None:
        sink = self._sink()
        self._choice(sink, "name", OPTIMIZERS)
        self._number(sink, "lr", strict=True)
        self._number(sink, "eps", strict=True)
        self._number(sink, "weight_decay")
        self._number(sink, "momentum")
        betas = self.betas
        if not (isinstance(betas, tuple) and len(betas) == 2
                and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
            self._bad(sink, "betas", f"betas must be two numbers in [0, 1), got {betas!r}")
        sink.raise_if_errors()


@dataclass(frozen=True, slots=True, kw_only=True)
class LRScheduleSpec(_Section):
    """Learning-rate schedule: linear warm-up, then constant, cosine or linear decay."""

    _path = "train.lr_schedule"
    kind: str = "constant"
    """"constant", "cosine" or "linear"."""
    warmup: int = 0
    """Warm-up steps (linear from 0 to lr)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    decay_steps: int | None = None
    """Steps over which to decay; None: the run's steps."""
    spans: Mapping[str, Span] = _spans()
    """Field name -> place in the plan file."""

    def __post_init__(self) -> None:
        sink = self._sink()
        self._choice(sink, "kind", LR_SCHEDULES)
        self._int(sink, "warmup", minimum=0)
        self._number(sink, "min_lr")
        self._int(sink, "decay_steps", allow_none=True)
        sink.raise_if_errors()


@dataclass(frozen=True, slots=True, kw_only=True)
class DataSpec(_Section):
    """Where tokens come from: a toy language or uniform noise from a seed, or a token file."""

    _path = "train.data"
    kind: str = "synthetic"
    """"synthetic" (a learnable toy language), "uniform" (noise) or "tokens"."""
    seed: int = 0
    """Seed of synthetic or uniform data."""
    path: str | None = None
    """Token file (.bin raw or .npy) for kind "tokens"."""
    dtype: str = "uint16"
    """Element type of a raw .bin token file."""
    spans: Mapping[str, Span] = _spans()
    """Field name -> place in the plan file."""

    def __post_init__(self) -> None:
        sink = self._sink()
        self._choice(sink, "kind", DATA_KINDS)
        self._int(sink, "seed", minimum=0)
        self._choice(sink, "dtype", TOKEN_DTYPES)
        if self.kind == "tokens" and not self.path:
            self._bad(sink, "path", "tokens data needs a file path, e.g. data = tokens(\"train.bin\")")
        sink.raise_if_errors()


@dataclass(frozen=True, slots=True, kw_only=True)
class InitSpec(_Section):
    """Initial weights: random from a seed, a full (unsharded) state-dict file, or a Hugging
    Face `save_pretrained` directory (safetensors)."""

    _path = "train.init"
    kind: str = "random"
    """"random", "state_dict" or "hf"."""
    seed: int = 0
    """Seed of random initialisation."""
    path: str | None = None
    """The state-dict file (kind "state_dict") or the save_pretrained directory ("hf")."""
    spans: Mapping[str, Span] = _spans()
    """Field name -> place in the plan file."""

    def __post_init__(self) -> None:
        sink = self._sink()
        self._choice(sink, "kind", INIT_KINDS)
        self._int(sink, "seed", minimum=0)
        if self.kind == "state_dict" and not self.path:
            self._bad(sink, "path", "state_dict init needs a file, e.g. init = state_dict(\"w.pt\")")
        if self.kind == "hf" and not self.path:
            self._bad(sink, "path", "hf init needs a save_pretrained directory, e.g. "
                                    "init = hf(\"llama-1b\")")
        sink.raise_if_errors()


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSpec(_Section):
    """What to train on and how long: batch shape, dtype, optimizer, data, init."""

    _path = "train"
    seq_len: int
    """Tokens per sample s."""
    global_batch: int
    """Samples per optimizer step, over all data-parallel ranks."""
    micro_batch: int = 1
    """Samples per micro-batch per rank, b."""
    dtype: str = "bf16"
    """Compute dtype: "fp32", "bf16" or "fp16" (master weights stay fp32); or "fp8", the
    hybrid recipe of Transformer Engine: everything in bf16 but the GEMMs of the layers'
    linears, whose operands are float8 (input and weight e4m3, output gradient e5m2, each
    with a scale), see `ptc.ops.fp8_linear`."""
    fp8_scaling: str = "delayed"
    """With dtype = "fp8": "current" scales each tensor by its own largest magnitude, now;
    "delayed" by the largest of the last `fp8_amax_history` steps' (Transformer Engine's
    default; a step with no history yet scales as "current")."""
    fp8_amax_history: int = 16
    """With fp8_scaling = "delayed": steps of largest magnitudes the scale is taken from."""
    fp8_recipe: str = "tensorwise"
    """With dtype = "fp8", the scaling granularity: "tensorwise" (one scale per tensor, e4m3
    forward and e5m2 gradients), "rowwise" (torchao's: one fp32 scale per row or column along
    each GEMM's contraction dimension, all e4m3) or "mxfp8" (OCP MX: one power-of-two scale
    per 32 consecutive elements along it, all e4m3). The last two scale current only."""
    fp8_emulate: bool = False
    """With dtype = "fp8": quantise and dequantise as the float8 GEMMs would, then multiply in
    fp32, on any device (checks the scaling on CPUs; without it a device lacking float8
    matmuls is refused before the run starts)."""
    grad_dtype: str = "fp32"
    """Dtype gradients are accumulated over micro-batches and reduced over dp in: "fp32"
    (main gradients, Megatron-LM's choice for bf16) or the compute dtype (half the gradient
    buffer and the dp traffic; the optimizer then steps the fp32 masters from an fp32 copy of
    the rank's gradient shard, as Megatron-LM does without grad_reduce_in_fp32)."""
    steps: int = 1
    """Optimizer steps to run."""
    grad_clip: float | None = 1.0
    """Global gradient-norm clip; None disables."""
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    """Optimizer."""
    lr_schedule: LRScheduleSpec = field(default_factory=LRScheduleSpec)
    """Learning-rate schedule."""
    data: DataSpec = field(default_factory=DataSpec)
    """Data source."""
    init: InitSpec = field(default_factory=InitSpec)
    """Initial weights."""
    spans: Mapping[str, Span] = _spans()
    """Field name -> place in the plan file."""

    def __post_init__(self) -> None:
        sink = self._sink()
        for name in ("seq_len", "global_batch", "micro_batch", "steps"):
            self._int(sink, name)
        self._choice(sink, "dtype", DTYPES)
        self._choice(sink, "fp8_scaling", FP8_SCALINGS)
        self._choice(sink, "fp8_recipe", FP8_RECIPES)
        self._check_recipe_scaling(sink)
        self._int(sink, "fp8_amax_history")
        self._bool(sink, "fp8_emulate")
        if self.grad_dtype not in ("fp32", self.compute_dtype):
            self._bad(sink, "grad_dtype", f"grad_dtype = {self.grad_dtype!r}: gradients are "
                      f"kept in fp32 or in the compute dtype ({self.compute_dtype})",
                      tuple(dict.fromkeys(("fp32", self.compute_dtype))))
        self._number(sink, "grad_clip", strict=True, allow_none=True)
        sink.raise_if_errors()

    def _check_recipe_scaling(self, sink: DiagnosticSink) -> None:
        """rowwise and mxfp8 scale each row or block by its amax now: no delayed scaling. The
        error points at fp8_scaling where the plan writes it, else at fp8_recipe."""
        if self.dtype != "fp8" or self.fp8_recipe not in FP8_RECIPES[1:] \
                or self.fp8_scaling != "delayed":
            return
        name = "fp8_scaling" if "fp8_scaling" in (self.spans or {}) else "fp8_recipe"
        self._bad(sink, name, f"fp8_recipe = {self.fp8_recipe} scales current only: "
                  "fp8_scaling must be current, got delayed (the default; delayed scaling is "
                  "tensorwise's)", ("current",))

    @property
    def compute_dtype(self) -> str:
        """The dtype activations and weights are kept and computed in: `dtype`, but "bf16"
        for "fp8" (float8 is only the layers' GEMM operands)."""
        return "bf16" if self.dtype == "fp8" else self.dtype


# ------------------------------------------------------------------- runtime


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeSpec(_Section):
    """How the run lives: backend, checkpoints, NaN policy, metrics."""

    _path = "runtime"
    backend: str = "auto"
    """"auto" (nccl on GPUs, gloo on CPUs), "nccl" or "gloo"."""
    checkpoint_dir: str | None = None
    """Directory of checkpoints; None disables checkpointing."""
    checkpoint_every: int | Auto | None = None
    """Save every N steps (None: only by time, if set); "auto": every τ seconds, Young and
    Daly's interval for the measured pause a save costs and the job's `mtbf`
    (`ptc.compiler.cost.goodput`)."""
    checkpoint_interval: float | None = None
    """Save every T seconds (None: only by steps)."""
    mtbf: float | None = None
    """The job's mean time between failures, seconds, for checkpoint_every = "auto" and the
    goodput `ptc explain` predicts; None: Llama 3's failure rate per GPU, scaled to the
    plan's GPUs."""
    keep: int = 3
    """Complete checkpoints to keep."""
    hang_timeout: float | Auto | None = "auto"
    """Seconds a step may run before it is a stall that stops (or restarts) the job, naming
    the rank that stalled it (`ptc.runtime.watchdog`); "auto": max(10 s, 5 × the median
    step so far); None: no stall watchdog (collectives still time out, `PTC_TIMEOUT`)."""
    snapshot_every: int | Auto | None = "auto"
    """Keep the training state in host memory every N steps, replicated on a peer, and
    restore a restarted group from it (`ptc.runtime.snapshot`); "auto": every step when
    the run checkpoints and the node's tmpfs holds a rank's state twice (its own copy
    and a peer's) for each of its ranks with half of it to spare, else none; None:
    storage only."""
    async_save: bool = True
    """Write checkpoints while training goes on."""
    nan_policy: str = "stop"
    """On a non-finite loss or gradient: "stop", "skip" the step, or "rollback"."""
    metrics: str | None = None
    """JSONL file of per-step metrics."""
    tensorboard: str | None = None
    """Directory of TensorBoard event files of the same metrics."""
    wandb: str | None = None
    """Weights & Biases project of a run that logs the same metrics; None: no W&B run.
    W&B's own environment (WANDB_MODE, WANDB_DIR, WANDB_API_KEY, ...) says where it goes."""
    seed: int = 0
    """Seed of everything random at run time (dropout)."""
    log_every: int = 1
    """Print a step line every N steps."""
    gc_every: int | None = 50
    """Collect Python's cyclic garbage every N steps, at the same step on every rank, with
    the automatic collector off in between (torchtitan's `gc_freq`, Megatron-LM's
    `--manual-gc`): left automatic, each rank's collector pauses it at its own moment and
    every collective of the step waits for the slowest; None: the automatic collector."""
    compile: bool = False
    """Run each lowered stage graph through `torch.compile` (inductor): fused kernels, faster
    steps on GPUs, and other rounding (fused ops sum in another order), so opt-in. The cost
    model prices each chain of memory-bound ops between GEMMs as one kernel when set
    (`ptc.compiler.graph.work`), each op as its own kernel when not."""
    spans: Mapping[str, Span] = _spans()
    """Field name -> place in the plan file."""

    def __post_init__(self) -> None:
        sink = self._sink()
        self._choice(sink, "backend", BACKENDS)
        self._int(sink, "checkpoint_every", allow_none=True, allow_auto=True)
        self._number(sink, "checkpoint_interval", strict=True, allow_none=True)
        self._number(sink, "mtbf", strict=True, allow_none=True)
        self._int(sink, "keep")
        self._int(sink, "snapshot_every", allow_none=True, allow_auto=True)
        if self.hang_timeout != AUTO:
            self._number(sink, "hang_timeout", strict=True, allow_none=True)
        if self.snapshot_every not in (None, AUTO) and not self.checkpoint_dir:
            self._bad(sink, "snapshot_every", "snapshot_every needs checkpoint_dir: a "
                      "restarted group finds its snapshots by it, and storage checkpoints "
                      "stay the fallback", ("none",))
        self._bool(sink, "async_save")
        self._choice(sink, "nan_policy", NAN_POLICIES)
        self._int(sink, "seed", minimum=0)
        self._int(sink, "log_every")
        self._int(sink, "gc_every", allow_none=True)
        self._bool(sink, "compile")
        if self.nan_policy == "rollback" and not self.checkpoint_dir:
            self._bad(sink, "nan_policy",
                      "nan_policy = rollback needs checkpoint_dir to roll back to",
                      ("stop", "skip"))
        sink.raise_if_errors()


@dataclass(frozen=True, slots=True, kw_only=True)
class MoESpec(_Section):
    """How a mixture of experts routes: dropless, or with a capacity per expert."""

    _path = "moe"
    capacity_factor: float | None = None
    """None: dropless, every routed row computed (the module's own semantics). A number:
    each expert computes at most ceil(capacity_factor · rows / experts) of the rows a rank
    routes to its layer (rows = tokens · top-k, the rank's own, before any exchange), as
    Megatron-LM's --moe-expert-capacity-factor; a dropped row adds nothing to its token's
    output. The run reports how many it dropped."""
    drop_policy: str = "probs"
    """Which rows over an expert's capacity are dropped: "probs", those of the lowest
    routing weight (Megatron-LM's default); "position", the last in the expert's order."""
    imbalance: float | None = None
    """The routing's load imbalance the cost model prices under expert parallelism: the
    rows the busiest ep rank's experts receive in a layer over the mean (>= 1). None: what
    `ptc calibrate` measured on the run's data where the plan's hardware profile holds it,
    else 1 (an even routing, as published MoE benchmarks force)."""
    spans: Mapping[str, Span] = _spans()
    """Field name -> place in the plan file."""

    def __post_init__(self) -> None:
        sink = self._sink()
        self._number(sink, "capacity_factor", strict=True, allow_none=True)
        self._choice(sink, "drop_policy", DROP_POLICIES)
        self._number(sink, "imbalance", minimum=1.0, allow_none=True)
        sink.raise_if_errors()


# ---------------------------------------------------------------------- plan


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A whole parallel training plan. Construction runs every semantic check."""

    model: ModelSpec
    """The model."""
    hardware: HardwareSpec
    """The machines."""
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    """The parallel layout."""
    train: TrainSpec
    """The training job."""
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    """The run's production settings."""
    moe: MoESpec = field(default_factory=MoESpec)
    """How mixture-of-experts layers route (dropless unless a capacity is set)."""
    source: str = field(default="<python>", compare=False)
    """Where the plan came from (file path), for messages; not part of equality,
    so a plan read back from `dump_plan` text equals the original."""
    warnings: tuple = field(default=(), compare=False, repr=False)
    """Warning diagnostics of the semantic check (e.g. tp spanning nodes)."""

    @property
    def routing_imbalance(self) -> float:
        """The routing imbalance the cost model prices (`MoESpec.imbalance`): the plan's own,
        else the one its hardware profile measured, else 1 (even)."""
        if self.moe.imbalance is not None:
            return float(self.moe.imbalance)
        if self.hardware.profile:
            measured = _profiled_imbalance(self.hardware.profile)
            if measured is not None:
                return measured
        return 1.0

    def __post_init__(self) -> None:
        from ptc.checks import check_plan  # noqa: PLC0415 - checks imports this module

        sink = DiagnosticSink()
        check_plan(self, sink)
        sink.raise_if_errors()
        object.__setattr__(self, "warnings", tuple(sink.warnings))

    @property
    def num_gpus(self) -> int:
        """Accelerators in the plan's hardware."""
        return self.hardware.num_gpus

    @property
    def is_resolved(self) -> bool:
        """True when no mesh axis (nor ep) is "auto"."""
        return all(self.parallel.degree(a) != AUTO for a in AXES) and self.parallel.ep != AUTO

    @property
    def grad_wire_bytes(self) -> int:
        """Bytes per gradient element the data-parallel reduction moves (ZeRO 0-2): one with
        float8 on the wire (`parallel.grad_comm`), else the gradient dtype's."""
        return 1 if self.parallel.grad_comm != "none" else DTYPE_BYTES[self.train.grad_dtype]

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step per pipeline (resolved plans only)."""
        if self.parallel.microbatches is not None:
            return self.parallel.microbatches
        dp = self.parallel.dp
        if dp == AUTO:
            raise ValueError("num_microbatches needs a resolved dp")
        return self.train.global_batch // (self.train.micro_batch * dp)

    @property
    def grad_ranks(self) -> int | Auto:
        """Ranks that hold different tokens of the same weights, dp·cp: the group gradients
        are averaged over and ZeRO shards over (as Megatron-LM's data-parallel group with
        context parallelism)."""
        dp, cp = self.parallel.dp, self.parallel.cp
        return AUTO if AUTO in (dp, cp) else dp * cp

    @property
    def expert_grad_ranks(self) -> int | Auto:
        """Ranks that hold the same routed experts, dp·cp/ep: the group an expert's gradient
        is averaged over and ZeRO shards it over (Megatron-Core's expert-data-parallel group)."""
        ranks, ep = self.grad_ranks, self.parallel.ep
        return AUTO if AUTO in (ranks, ep) else max(1, ranks // ep)


def _layer_index(cut: str) -> int | None:
    """The layer a pipeline cut names ("layers.20", "model.layers.20" -> 20), else None."""
    last = cut.rsplit(".", 1)[-1] if "." in cut else ""
    return int(last) if last.isdigit() else None


def _each_stage_has_layers(starts: dict[int, int]) -> bool:
    """Whether pinned stage starts {stage: first layer} leave every stage a layer."""
    pinned = sorted(starts.items())
    return all(l1 - l0 >= s1 - s0 for (s0, l0), (s1, l1) in zip(pinned, pinned[1:]))
