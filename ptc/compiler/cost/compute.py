"""Compute time of one micro-batch, op by op, from the work the captured graph asks for.

Terms (per rank, per micro-batch; `ModelProfile.work`, `ptc.compiler.graph.work`):
G the FLOPs of its GEMMs (G8 of them float8 GEMMs), A the FLOPs of fused
attention kernels, M the bytes memory-bound ops move, N the ops dispatched.
A runtime that fuses (`runtime.compile`: inductor, as Megatron-LM's and
Transformer Engine's hand-fused kernels do) runs each chain of memory-bound
ops between two GEMMs as one kernel: M is then what those kernels read and
write (each tensor made outside the chain read once, each tensor read
outside it written once) and N the kernels launched (`ptc.compiler.graph.work`).
Each physical effect has one rate (`Rates`, from the hardware section):

- GEMMs run at R = `HardwareSpec.gemm_rate(dtype)` (a calibration's measured
  rate, else peak x achievable_fraction x the clock share a power limit leaves,
  `HardwareSpec.clock_share`), float8 GEMMs at R8 (the fp8 peak, likewise); a fused
  attention kernel's matrix products run at Ra = `HardwareSpec.attention_rate(dtype)`
  (R, unless the hardware names the kernel's own share of peak: `attention_fraction`);
- memory-bound ops (element-wise, norms, softmax, the loss, copies) and the
  attention kernel's reads and writes move their bytes at B = mem_bandwidth;
- the host spends o = dispatch_overhead dispatching each op.

Kernel time K = G/R + G8/R8 + A/Ra + M/B. On a CPU the host runs the kernels
itself, so a phase takes K + N·o; on a GPU the host queues kernels while the
device runs earlier ones, so it takes max(K, N·o) (the slower of the two
sets the pace).

How parallelism divides the work: tensor parallelism splits the "tp" class
(from a column-parallel linear to the row-parallel one that closes the block)
by t, its key/value part by `kv_divisor`; the rest is replicated over tp,
unless sequence parallelism splits it along the sequence (1/t), all but the
"whole" class: a module a rule keeps whole, run on the whole sequence where it
mixes positions. Context
parallelism gives each rank s/cp positions in two chunks, whose queries meet the keys
up to their chunk's end: the attention core's work is `key_tile_share(cp)` of every
tile of the whole sequence's (`ptc.ops.context`; twice what the profile counts where
the model's kernel is a causal one that skips half, `ModelProfile.causal_kernel`).
Every rank dispatches every op.
"""

from __future__ import annotations

from dataclasses import dataclass

from ptc.compiler.graph.gemm_tiles import efficiency
from ptc.compiler.graph.work import CAUSAL_SHARE
from ptc.compiler.profile.types import ModelProfile
from ptc.compiler.profile.measure import rerun_region
from ptc.ops.context import key_tile_share
from ptc.plan import HardwareSpec, policy_modules


@dataclass(frozen=True, slots=True)
class Rates:
    """The rate of each physical effect, for one compute dtype."""

    gemm: float
    """FLOP/s of matrix products."""
    attention: float
    """FLOP/s of a fused attention kernel's matrix products."""
    fp8: float | None
    """FLOP/s of float8 GEMMs (train dtype fp8), else None."""
    memory: float
    """Bytes/s memory-bound ops move."""
    dispatch: float
    """Host seconds per op dispatched."""
    synchronous: bool
    """The host runs the kernels itself (a CPU): dispatch adds to kernel time."""
    multiprocessors: int = 0
    """The GPU's streaming multiprocessors: GEMMs are priced at their shape's tile and wave
    efficiency (`ptc.compiler.graph.gemm_tiles`); 0: by their FLOPs alone (a CPU, or a measured
    GEMM rate, which was measured at the plan's own shapes)."""


def rates(hw: HardwareSpec, dtype: str) -> Rates:
    """The rates of `hw` for train dtype `dtype`; fp8 computes in bf16 but for its float8
    GEMMs (at the fp8 peak, or bf16's where the hardware has none: emulated)."""
    compute = "bf16" if dtype == "fp8" else dtype
    fp8 = None
    if dtype == "fp8":
        fp8 = hw.gemm_flops.get("fp8") or hw.peak_flops.get("fp8", hw.peak_flops["bf16"]) \
            * hw.achievable_fraction * hw.clock_share
    return Rates(gemm=hw.gemm_rate(compute), attention=hw.attention_rate(compute), fp8=fp8,
                 memory=hw.mem_bandwidth,
                 dispatch=hw.dispatch_overhead, synchronous=hw.synchronous,
                 multiprocessors=0 if compute in hw.gemm_flops else hw.multiprocessors)


@dataclass(frozen=True, slots=True)
class PhaseWork:
    """What one rank does in one phase (forward or backward) of some region."""

    gemm: float = 0.0
    """GEMM FLOPs, float8 ones excluded."""
    fp8: float = 0.0
    """Float8 GEMM FLOPs."""
    attention: float = 0.0
    """Fused attention FLOPs."""
    memory: float = 0.0
    """Bytes moved by memory-bound ops."""
    ops: float = 0.0
    """Ops dispatched."""

    def kernel_seconds(self, r: Rates) -> float:
        """K: the device's time for these kernels."""
        return (self.gemm / r.gemm + (self.fp8 / r.fp8 if self.fp8 else 0.0)
                + self.attention / r.attention + self.memory / r.memory)

    def seconds(self, r: Rates) -> float:
        """K + N·o on a CPU, max(K, N·o) on a GPU (module docstring)."""
        kernels, host = self.kernel_seconds(r), self.ops * r.dispatch
        return kernels + host if r.synchronous else max(kernels, host)


@dataclass(frozen=True, slots=True)
class LayerTimes:
    """Seconds of one micro-batch's compute on one rank, by part."""

    forward: float
    """One transformer layer's forward."""
    backward: float
    """One transformer layer's backward."""
    core: float
    """The forward of one layer's attention core (what selective recompute reruns)."""
    pre: float
    """Forward and backward of what comes before the first layer (the embedding)."""
    post: float
    """Forward and backward of what comes after the last layer (norm, head, loss)."""
    pre_forward: float
    """The forward part of `pre`."""
    post_forward: float
    """The forward part of `post`."""
    recompute: dict[str, float]
    """Per recompute policy the layer can take: the forward it reruns in backward (none: 0,
    selective: `core`, full: `forward`, the others: the ops their regions rerun)."""
    weight_grad: float = 0.0
    """The part of `backward` that computes one layer's weight gradients, a split
    backward's W (`weight_gradient_work`)."""
    post_weight_grad: float = 0.0
    """The same of what comes after the last layer (the head's weight gradient)."""


@dataclass(frozen=True, slots=True)
class Split:
    """How parallelism divides a rank's work (module docstring)."""

    tp: int
    kv_divisor: int
    sp: bool
    cp: int


def phase_work(profile: ModelProfile, region: str, phase: str, bb: int, ss: int, split: Split,
               seq_len: int, *, fused: bool = False, keys: bool | None = None,
               multiprocessors: int = 0) -> PhaseWork:
    """One rank's work in `region` ("pre", "layer", "post", "core" or a policy's
    `rerun_region`) and `phase` ("fwd", "bwd") for a micro-batch of `bb` samples of `ss`
    positions each (of `seq_len`); `fused`: memory-bound ops as fused kernels
    (`ptc.compiler.graph.work`); `keys`: whether the region holds the attention core, whose
    queries meet all keys under cp (default: "layer" and "core" do). With
    `multiprocessors` (a GPU's SMs) the GEMM FLOPs are those the GEMMs run, their shapes'
    tiles and waves included (`ptc.compiler.graph.gemm_tiles.efficiency`)."""
    f = profile.fn
    prefix = "work_b1" if bb == 1 else "work"
    if keys is None:
        keys = region in ("layer", "core")

    def term(name: str, b_: int, s_: int) -> float:
        return f[f"{prefix}.{region}.{phase}.{name}"](b_, s_)

    def per_rank(quantity: str) -> float:
        classes = ("all", "tp", "kv", "whole")
        total, tp, kv, seq_whole = (term(f"{quantity}.{c}", bb, ss) for c in classes)
        if split.cp > 1 and keys:  # the core's queries meet the keys before their chunk
            every_tile = CAUSAL_SHARE if quantity == "attn" and profile.causal_kernel else 1
            total, tp, kv, seq_whole = (
                v + _core_keys(f, prefix, phase, f"{quantity}.{c}", bb, seq_len, ss, split.cp,
                               every_tile)
                for v, c in zip((total, tp, kv, seq_whole), classes))
        rest = total - tp
        return ((rest - seq_whole) / split.tp + seq_whole if split.sp else rest) \
            + (tp - kv) / split.tp + kv / split.kv_divisor

    fp8 = 0.0
    if region == "layer":  # float8 GEMMs: the linears' forward, and dgrad and wgrad
        fp8 = f["fp8_flops"](bb, ss) / split.tp * (1 if phase == "fwd" else 2)
    gemm = per_rank("gemm") - fp8
    if multiprocessors:
        tiles = tile_efficiency(profile, region, phase, bb, ss, split, multiprocessors)
        gemm, fp8 = gemm / tiles, fp8 / tiles
    return PhaseWork(gemm=gemm, fp8=fp8, attention=per_rank("attn"),
                     memory=per_rank("fmem" if fused else "mem"),
                     ops=term("kern.all" if fused else "ops.all", bb, ss))


def weight_gradient_work(profile: ModelProfile, region: str, bb: int, ss: int, split: Split,
                         seq_len: int, *, multiprocessors: int = 0) -> PhaseWork:
    """The weight gradients of `region` ("layer" or "post"), what a split backward's W runs:
    one GEMM per linear, dW = dYᵀX, with its forward's FLOPs (the forward's GEMMs less the
    attention core's, which multiply activations by activations; float8 ones in float8),
    and one kernel per weight tensor. The rest of the backward (input gradients,
    elementwise ops, the attention core) is the I."""
    forward = phase_work(profile, region, "fwd", bb, ss, split, seq_len,
                         multiprocessors=multiprocessors)
    core = phase_work(profile, "core", "fwd", bb, ss, split, seq_len,
                      multiprocessors=multiprocessors) if region == "layer" else PhaseWork()
    return PhaseWork(gemm=max(0.0, forward.gemm - core.gemm), fp8=forward.fp8,
                     ops=profile.params[region].tensors)


def tile_efficiency(profile: ModelProfile, region: str, phase: str, bb: int, ss: int,
                    split: Split, multiprocessors: int) -> float:
    """The share of full waves one rank's GEMMs of `region`'s `phase` run
    (`ptc.compiler.graph.gemm_tiles.efficiency`; 1 where the profile has no shapes for it)."""
    shapes = (profile.gemms_b1 if bb == 1 else profile.gemms).get(f"{region}.{phase}", ())
    return efficiency(shapes, bb, ss, tp=split.tp, kv_divisor=split.kv_divisor, sp=split.sp,
                      multiprocessors=multiprocessors)


def _core_keys(f, prefix: str, phase: str, name: str, bb: int, seq_len: int, ss: int,
               cp: int, every_tile: int = 1) -> float:
    """What a rank's attention core does beyond a sequence of `ss` positions under cp: its
    queries meet the keys up to their chunk's end, `key_tile_share(cp)` of every tile of the
    whole sequence's core (`every_tile` times the profile's: the tiles a causal kernel
    skips included)."""
    core = f[f"{prefix}.core.{phase}.{name}"]
    return every_tile * core(bb, seq_len) * key_tile_share(cp) - core(bb, ss)


def layer_times(profile: ModelProfile, r: Rates, *, bb: int, ss: int, seq_len: int,
                split: Split, fused: bool = False) -> LayerTimes:
    """Seconds of each part of one micro-batch on one rank (see `LayerTimes`), with
    memory-bound ops as fused kernels when `fused`; remembered in the profile's memo (plan
    search asks for the same ones for thousands of layouts)."""
    key = ("layer_times", r, bb, ss, seq_len, split, fused)
    if key in profile.memo:
        return profile.memo[key]

    def seconds(region: str, phase: str, keys: bool | None = None) -> float:
        return phase_work(profile, region, phase, bb, ss, split, seq_len, fused=fused,
                          keys=keys, multiprocessors=r.multiprocessors).seconds(r)

    forward, core = seconds("layer", "fwd"), seconds("core", "fwd")
    recompute = {"none": 0.0, "selective": core, "full": forward}
    recompute.update({p: seconds(rerun_region(p), "fwd",
                                 keys="core_attn" in (policy_modules(p) or ()))
                      for p in profile.policy_flops})
    pre, post = seconds("pre", "fwd"), seconds("post", "fwd")

    def weight_grad(region: str) -> float:
        return weight_gradient_work(profile, region, bb, ss, split, seq_len,
                                    multiprocessors=r.multiprocessors).seconds(r)

    times = LayerTimes(forward=forward, backward=seconds("layer", "bwd"), core=core,
                       pre=pre + seconds("pre", "bwd"), post=post + seconds("post", "bwd"),
                       pre_forward=pre, post_forward=post, recompute=recompute,
                       weight_grad=weight_grad("layer"), post_weight_grad=weight_grad("post"))
    profile.memo[key] = times
    return times
