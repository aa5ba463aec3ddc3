"""`ptc calibrate PLAN -o hw.json`: measure the rates the cost model prices a step with.

On the plan's device, in the plan's processes (all ranks at once, as a step
runs them: on a CPU the ranks share its cores), each rank times three probes
and the mesh axes' collectives; rank 0 writes what they found as a hardware
profile (`ptc.hwprofile`) a plan names with `hardware { profile = "hw.json" }`.

Probes, each a forward and backward with autograd, timed over repetitions
(the same count on every rank) and counted op by op as the cost model counts
a model's graph (`ptc.compiler.graph.work.function_work`: GEMM FLOPs, bytes moved,
ops dispatched):

- dispatch: a one-layer model of the plan's family at hidden size 8 and two
  tokens (made by the `build` handed in: `ptc.models.build_model`), run as
  the runtime runs a stage graph (counted by `ptc.compiler.graph.work.graph_work`),
  whose kernels do almost nothing: seconds per op dispatched, o = t / N;
- memory: a chain of element-wise, norm, softmax and view ops on a rank's
  activations (micro-batch × the sequence a rank holds × hidden, the plan's
  compute dtype): bytes per second, B = M / (t - N·o) on a CPU, M / t on a GPU;
- GEMM: the linears of a layer at the rank's shapes (hidden to 3·hidden/tp
  and back, hidden to ffn/tp and back): FLOP/s, R = G / (t - M/B - N·o) on a
  CPU, G / (t - M/B) on a GPU.

A rate is read off the kernels' time, so where dispatching a probe's ops
would take more than a tenth of it (a tiny model), the probe runs on more
tokens (doubling, at most `MAX_SCALE` times), the widths staying the plan's.

A round of a probe runs its repetitions on every rank at once; its time is
the mean over the repetitions and the ranks (a rank that shares its cores
with others is descheduled now and then, and its steps pay for that too).
The three probes run in interleaved rounds, and each takes its median round,
so a burst of other work on the machine moves one round, not the figure.

Power: on a CUDA device, its enforced power limit and the SM clock it sustained
in the GEMM probe (sampled after each round, the median kept) are read through
NVML (the optional `pynvml` module of nvidia-ml-py, which torch.cuda reads
clocks with too), so the profile describes the part as capped; on a CPU, or
where NVML cannot be reached, the profile says why instead.

Links: on every mesh axis with more than one rank, all-reduce, all-gather,
reduce-scatter and send/recv at message sizes from `min_size` to `max_size`
(times 4), timed as `ptc bench-comm` times them (the slowest rank's mean);
each link's latency and bandwidth are fitted to them through the cost
model's own collectives (`ptc.compiler.cost.linkfit`), and each axis's own fit is
recorded beside them.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ptc.compiler.capture import capture, with_weights
from ptc.compiler.cost.linkfit import Measurement, fit_links
from ptc.compiler.profile.cache import with_model_shape
from ptc.compiler.records.params import COMPUTE_DTYPES
from ptc.compiler.cost.topology import axis_placements as placement
from ptc.compiler.graph.work import Work, function_work, graph_work
from ptc.hwprofile import HardwareProfile, Link, Power
from ptc.plan import ModelSpec, Plan
from ptc.runtime.calibrate_routing import measure_routing
from ptc.runtime.init import ModelBuilder, ModelFactory
from ptc.runtime.train import Compiler

KiB, MiB = 2**10, 2**20


@dataclass(frozen=True, slots=True)
class Settings:
    """How long and how widely to measure."""

    seconds: float = 0.3
    """Time one round of each compute probe runs for, about."""
    rounds: int = 5
    """Rounds of the three compute probes, interleaved; each probe's time is its median
    round."""
    min_size: int = 4 * KiB
    """Smallest collective message, bytes."""
    max_size: int = 16 * MiB
    """Largest collective message, bytes (sizes step by 4x)."""
    iters: int = 10
    """Timed collectives per size."""
    warmup: int = 3
    """Untimed collectives per size."""
    routing_steps: int = 2
    """Training steps of the run's data whose routing an ep plan's imbalance is measured
    over (`ptc.runtime.calibrate_routing`)."""


def calibrate(plan: Plan, settings: Settings = Settings(), *,
              build: ModelBuilder, routing: RoutingRun | None = None) -> HardwareProfile:
    """Measure `plan`'s device and links (starting its processes) and return the profile;
    `build` makes the dispatch probe's model (`ptc.models.build_model`, handed in from above).
    `routing`: how to train the plan (its compiler and models, handed in from above), for
    an expert-parallel plan's routing imbalance; without it none is measured."""
    from ptc.runtime.launcher import in_worker, run_local  # noqa: PLC0415
    from ptc.runtime.mesh import world_size  # noqa: PLC0415

    if in_worker() or dist.is_initialized():
        return calibrate_worker(plan, settings, build, routing)
    return run_local(calibrate_worker, world_size(plan), plan, settings, build, routing)[0]


@dataclass(frozen=True)
class RoutingRun:
    """What measuring an ep plan's routing needs from above: the compiler that lowers the
    plan (`ptc.lower.driver.compile_plan`) and the models that build it (`ptc.worker.MODELS`)."""

    compiler: Compiler
    models: ModelFactory


def calibrate_worker(plan: Plan, settings: Settings, build: ModelBuilder,
                     routing: RoutingRun | None = None) -> HardwareProfile:
    """One rank's part of `calibrate` (collective over all ranks); rank 0's is the profile."""
    from ptc.runtime.mesh import (  # noqa: PLC0415
        axis_process_groups,
        build_mesh,
        device_for,
        init_distributed,
    )

    created = init_distributed(plan)
    try:
        device = device_for(plan)
        dtype = COMPUTE_DTYPES[plan.train.compute_dtype]
        shapes = probe_shapes(plan)
        dispatch = dispatch_probe(plan, device, dtype, settings.seconds, build)
        o = dispatch.run() / dispatch.work.ops  # sizes the other two probes
        memory = memory_probe(device, dtype, shapes, settings.seconds, o)
        gemm = gemm_probe(device, dtype, shapes, settings.seconds, o)
        meter = PowerMeter(device)
        for _ in range(settings.rounds):  # interleaved: the machine's mood hits all three
            for probe in (dispatch, memory, gemm):
                probe.run()
            meter.sample()  # right after the GEMM round: the clock it sustained
        probes = {"dispatch": dispatch.record(), "memory": memory.record(),
                  "gemm": gemm.record()}
        o = dispatch.seconds / dispatch.work.ops
        sync = device.type != "cuda"
        memory_s = memory.seconds - (memory.work.ops * o if sync else 0.0)
        bandwidth = memory.work.memory / max(memory_s, 0.1 * memory.seconds)
        gemm_s = gemm.seconds - gemm.work.memory / bandwidth - (gemm.work.ops * o if sync else 0.0)
        rate = gemm.work.gemm / max(gemm_s, 0.1 * gemm.seconds)
        groups = axis_process_groups(build_mesh(plan), plan.parallel.ep)
        measurements, axes = _links(plan, device, settings, groups)
        routed = measure_routing(plan, groups, compiler=routing.compiler, models=routing.models,
                                 device=device, steps=settings.routing_steps) \
            if routing is not None and plan.parallel.ep > 1 else None
        if dist.get_rank() != 0:
            return None
        fit = fit_links(measurements, plan.hardware)
        return HardwareProfile(
            device="cuda" if device.type == "cuda" else "cpu",
            gemm_flops={plan.train.compute_dtype: rate}, mem_bandwidth=bandwidth,
            dispatch_overhead=o,
            links={name: Link(bandwidth=link.bandwidth, latency=link.latency)
                   for name, link in fit.links.items()},
            power=meter.reading(), routing=routed,
            info={"world_size": dist.get_world_size(), "device_name": _device_name(device),
                  "torch": torch.__version__, "threads": torch.get_num_threads(),
                  "created": datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="seconds"),
                  "plan": plan.source, "shapes": shapes,
                  "links_fit": {"median_error": fit.median_error, "max_error": fit.max_error},
                  "axes": axes, "probes": probes})
    finally:
        if created:
            dist.destroy_process_group()


def probe_shapes(plan: Plan) -> dict[str, int]:
    """The sizes the probes use: tokens a rank holds per micro-batch, hidden, and the
    rank's widths of the attention projections and of the MLP."""
    model = with_model_shape(plan).model
    par = plan.parallel
    tokens = plan.train.micro_batch * plan.train.seq_len // par.degree("cp")
    ffn = model.ffn or 4 * model.hidden
    tp = par.degree("tp")
    return {"tokens": tokens, "hidden": model.hidden,
            "qkv": max(1, 3 * model.hidden // tp), "ffn": max(1, ffn // tp)}


class Probe:
    """One probe, ready to run: its function and arguments, its work per repetition, and
    the repetitions one round runs (the same on every rank)."""

    def __init__(self, fn: Callable[..., torch.Tensor], make: Callable[[torch.device, int], tuple],
                 device: torch.device, seconds: float, dispatch: float | None = None, *,
                 work: Work | None = None):
        """Count `fn(*make(device, scale))`'s work and size its rounds to about `seconds`.

        With `dispatch` (seconds per op), the token count doubles (up to `MAX_SCALE`
        times) while dispatching the probe's ops would take more than a tenth of one
        repetition: a rate is read off the kernels' time, which must dominate it."""
        self.fn, self.device = fn, device
        self.scale = 1
        self.work, self.args = self._count(make, work), make(device, 1)
        first = self._first()
        while dispatch is not None and first < 10 * self.work.ops * dispatch and \
                self.scale < MAX_SCALE:
            self.scale *= 2
            self.work, self.args = self._count(make, work), make(device, self.scale)
            first = self._first()
        self.repetitions = int(min(2000, max(3, seconds / max(first, 1e-9))))
        self.rounds: list[float] = []

    def _once(self, args) -> None:
        for a in args:
            a.grad = None
        self.fn(*args).backward()

    def _count(self, make, work: Work | None) -> Work:
        if work is not None:
            return work
        forward, backward = function_work(
            lambda: self._once(make(torch.device("meta"), self.scale)))
        total = Work()
        total.add(forward)
        total.add(backward)
        return total

    def _first(self) -> float:
        self._once(self.args)  # warm up: allocations, kernel selection
        _sync(self.device)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            self._once(self.args)
            _sync(self.device)
            times.append(time.perf_counter() - start)
        return _slowest(statistics.median(times), self.device)

    def run(self) -> float:
        """One round on every rank at once: seconds per repetition, the mean over the round's
        repetitions and over ranks (not the median: ranks sharing cores are descheduled now
        and then, and a step pays for that as much as for the kernels)."""
        _barrier()
        start = time.perf_counter()
        for _ in range(self.repetitions):
            self._once(self.args)
        _sync(self.device)
        seconds = _mean((time.perf_counter() - start) / self.repetitions, self.device)
        self.rounds.append(seconds)
        return seconds

    @property
    def seconds(self) -> float:
        """The median round: a burst of other work on the machine moves one round, not it."""
        return statistics.median(self.rounds)

    def record(self) -> dict[str, Any]:
        """For the profile file."""
        return {"seconds": self.seconds, "rounds": self.rounds, "gemm_flops": self.work.gemm,
                "bytes": self.work.memory, "ops": self.work.ops,
                "repetitions": self.repetitions, "token_scale": self.scale}


def _chain(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Element-wise, norm, softmax and view ops as a layer has them, with a scalar result."""
    h = F.layer_norm(x, x.shape[-1:], weight)
    h = F.gelu(h) * 0.5 + x
    h = torch.softmax(h.transpose(0, 1), dim=-1).transpose(0, 1)
    return (h * x).sum()


def _linears(x: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, up: torch.Tensor,
             down: torch.Tensor) -> torch.Tensor:
    """A layer's four linears at a rank's shapes, with a scalar result."""
    a = F.linear(F.linear(x, qkv)[:, : out.shape[1]], out)
    return (F.linear(F.linear(x, up), down) + a).sum()


def dispatch_probe(plan: Plan, device: torch.device, dtype: torch.dtype,
                   seconds: float, build: ModelBuilder) -> Probe:
    """A one-layer model of the plan's family (GPT for a custom model) at hidden size 8 and
    two tokens, captured and run forward and backward as the runtime runs a stage graph
    (its generated code, its modules, autograd): its kernels do almost nothing, so what it
    takes is dispatch. Its ops are counted from the graph as a model's profile counts them
    (`ptc.compiler.graph.work.graph_work`)."""
    family = plan.model.family if plan.model.family in ("gpt", "llama") else "gpt"
    spec = ModelSpec(family=family, layers=1, hidden=8, heads=2, kv_heads=2, ffn=16, vocab=16,
                     max_seq=2)
    gm = capture(build(spec), micro_batch=1, seq_len=2, dtype=dtype)
    work = Work()
    for node_work in graph_work(gm, [torch.zeros(1, 2, dtype=torch.long, device="meta")] * 2
                                ).values():
        work.add(node_work.forward)
        work.add(node_work.backward)
    runnable = with_weights(gm, build(spec, device=device).to(dtype))
    tokens = torch.zeros(1, 2, dtype=torch.long, device=device)
    return Probe(lambda *args: runnable(tokens, tokens), lambda dev, scale: (), device, seconds,
                 work=work)


def memory_probe(device: torch.device, dtype: torch.dtype, shapes: dict[str, int],
                 seconds: float, dispatch: float) -> Probe:
    """The element-wise chain on a rank's activations (more tokens where dispatching its
    ops would take more than a tenth of its time: `Probe`)."""
    def make(dev, scale):
        return (torch.randn(shapes["tokens"] * scale, shapes["hidden"], device=dev,
                            dtype=dtype, requires_grad=True),
                torch.randn(shapes["hidden"], device=dev, dtype=dtype, requires_grad=True))
    return Probe(_chain, make, device, seconds, dispatch)


def gemm_probe(device: torch.device, dtype: torch.dtype, shapes: dict[str, int],
               seconds: float, dispatch: float) -> Probe:
    """A layer's linears at a rank's widths (more tokens as `memory_probe`)."""
    m, h, qkv, ffn = shapes["tokens"], shapes["hidden"], shapes["qkv"], shapes["ffn"]

    def make(dev, scale):
        def w(*shape):
            return (torch.randn(*shape, device=dev, dtype=dtype) / shape[-1] ** 0.5
                    ).requires_grad_()
        return (torch.randn(m * scale, h, device=dev, dtype=dtype, requires_grad=True),
                w(qkv, h), w(h, min(h, qkv)), w(ffn, h), w(h, ffn))
    return Probe(_linears, make, device, seconds, dispatch)


MAX_SCALE = 256
"""Most times the tokens a probe may grow to (`Probe`)."""


class PowerMeter:
    """A CUDA device's power limit and SM clock, read through NVML (the optional `pynvml`
    module of nvidia-ml-py: not a dependency of ptc); on a CPU, or where NVML cannot be
    reached, why they are unknown."""

    def __init__(self, device: torch.device):
        """Open the device's NVML handle, or record why there is none."""
        self.clocks: list[float] = []
        self.handle, self.nvml, self.why = None, None, ""
        if device.type != "cuda":
            self.why = "a CPU has no power limit"
            return
        try:
            import pynvml  # noqa: PLC0415 - optional: only a CUDA device has a limit to read

            pynvml.nvmlInit()
            uuid = torch.cuda.get_device_properties(device).uuid
            self.handle, self.nvml = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}"), pynvml
        except Exception as exc:  # noqa: BLE001 - no pynvml, no driver, or NVML refuses
            self.why = (f"NVML cannot be read ({type(exc).__name__}: {exc}); "
                        "pip install nvidia-ml-py to record the power limit and clock")

    def sample(self) -> None:
        """Record the SM clock (MHz) over NVML's last sample period."""
        if self.handle is not None:
            self.clocks.append(float(self.nvml.nvmlDeviceGetClockInfo(
                self.handle, self.nvml.NVML_CLOCK_SM)))

    def reading(self) -> Power:
        """The enforced power limit (watts) and the median sampled clock, or why not."""
        if self.handle is None:
            return Power(unmeasured=self.why)
        limit = self.nvml.nvmlDeviceGetEnforcedPowerLimit(self.handle) / 1000
        clock = statistics.median(self.clocks) if self.clocks else None
        return Power(limit=limit, sm_clock=clock,
                     unmeasured="" if clock is not None else "no GEMM round ran")


def _links(plan: Plan, device: torch.device, settings: Settings,
           groups: dict[str, dist.ProcessGroup]) -> tuple[list[Measurement], dict]:
    """Collectives on every axis with more than one rank; (measurements, per-axis fits)."""
    from ptc.runtime.bench_comm import OPS, _time

    p = plan.parallel
    places = placement({a: p.degree(a) for a in p.order}, p.order, plan.hardware.gpus_per_node)
    measurements, per_axis = [], {}
    for axis in p.order:
        where = places[axis]
        if where.size == 1:
            continue
        mine = []
        for op in OPS:
            size = settings.min_size
            while size <= settings.max_size:
                whole = size - size % (4 * where.size)  # whole fp32 elements per rank
                seconds = _time(op, whole, groups[axis], device, settings.iters, settings.warmup)
                mine.append(Measurement(op, float(whole), where, seconds))
                size *= 4
        measurements += mine
        fit = fit_links(mine, plan.hardware)
        per_axis[axis] = {"ranks": where.size, "link": where.link,
                          **{name: {"bandwidth": link.bandwidth, "latency": link.latency}
                             for name, link in fit.links.items()},
                          "median_error": fit.median_error, "max_error": fit.max_error,
                          "measured": [[m.op, m.size, m.seconds] for m in mine]}
    return measurements, per_axis


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _slowest(value: float, device: torch.device) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _mean(value: float, device: torch.device) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def render_profile(profile: HardwareProfile, plan: Plan) -> str:
    """What was measured, one figure a line, against the plan's current figures."""
    from ptc.units import format_seconds  # noqa: PLC0415

    hw = plan.hardware
    dtype = plan.train.compute_dtype
    lines = [f"measured on {profile.info.get('device_name', profile.device)} "
             f"({profile.device}), {profile.info.get('world_size', 1)} processes at once",
             f"  GEMM          {profile.gemm_flops[dtype] / 1e9:,.1f} GFLOP/s {dtype} "
             f"(plan: {hw.gemm_rate(dtype) / 1e9:,.1f})",
             f"  memory-bound  {profile.mem_bandwidth / 1e9:,.2f} GB/s "
             f"(plan: {hw.mem_bandwidth / 1e9:,.2f})",
             f"  dispatch      {format_seconds(profile.dispatch_overhead)} per op "
             f"(plan: {format_seconds(hw.dispatch_overhead)})"]
    plan_limit = _watts(hw.power_limit) if hw.power_limit is not None else "none"
    lines.append(f"  power         {_power_line(profile.power)} (plan: power_limit {plan_limit})")
    for name, link in profile.links.items():
        old = getattr(hw, name)
        lines.append(f"  {name:<13} {format_seconds(link.latency)} + {link.bandwidth / 1e9:,.3f} "
                     f"GB/s (plan: {format_seconds(old.latency)} + "
                     f"{old.bandwidth / 1e9:,.3f} GB/s)")
    for axis, fit in profile.info.get("axes", {}).items():
        lines.append(f"  axis {axis}: {fit['ranks']} ranks on the {fit['link']} link; the "
                     f"fitted link reproduces its collectives within "
                     f"{fit['median_error']:.0%} (median), {fit['max_error']:.0%} (worst)")
    if profile.routing is not None:
        written = plan.moe.imbalance
        lines.append(f"  routing       the busiest of ep {profile.routing.ep} ranks receives "
                     f"{profile.routing.imbalance:.3f}x the mean rows ({profile.routing.steps} "
                     f"steps of the run's data; plan: moe.imbalance "
                     f"{'unset' if written is None else f'{written:g}'})")
    return "\n".join(lines)


def _power_line(power: Power | None) -> str:
    """The power limit and sustained clock a profile records, or why it has none."""
    if power is None or power.limit is None:
        return f"not measured: {power.unmeasured if power else 'not recorded'}"
    clock = f"{power.sm_clock:,.0f} MHz" if power.sm_clock is not None else power.unmeasured
    return f"limit {_watts(power.limit)}, SM clock in the GEMM probe {clock}"


def _watts(value: float) -> str:
    return f"{value:g} W"
