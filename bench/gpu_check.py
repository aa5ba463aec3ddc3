"""One short GPU slot's worth of checks: ptc against eager PyTorch on this machine's devices.

    python bench/gpu_check.py [--out gpu_check.json] [--steps N] [--quick] [--skip-1b]
                              [--no-compile] [--budget SECONDS]

Made for rare, short GPU slots (one H200 for a few minutes): everything runs
in one process in about 4 minutes, and every part is guarded, so a failure
is recorded (with its error line) and the next part still runs: one slot
always yields a table and a JSON file. Without CUDA it runs on the CPU with
small sizes (under a minute), which is how `tests/test_gpu_check.py` keeps it
working.

What it measures, on the first CUDA device (else the CPU):

1. Training equality. The tiny example plan (`examples/tiny_gpt_cpu.ptc` on
   one process, fp32) and a Llama (on CUDA ~1.1B: 16 layers, hidden 2048,
   GQA 16/8 heads, ffn 8192, vocab 32000, seq 2048, bf16; on the CPU or with
   `--quick` a 2-layer one) are trained with tp = pp = dp = 1 by ptc's
   Trainer and by plain eager PyTorch from the same initial weights on the
   same samples: ptc's bf16 recipe on the eager side (the model computes in
   bf16, gradients accumulate per micro-batch into fp32 masters, AdamW with
   the plan's hyperparameters on the masters, the plan's learning-rate
   schedule and global-norm clip). The losses of every step must agree
   within the tolerance `loss_tolerance` states, and the trained weights
   within `compare_weights`' (their distance against how far training moved
   them: the stronger witness in bf16). The compiled rows' losses (below) are
   held to the same loss tolerance.
2. Speed. Median step time (after warm-up; CUDA synchronised before each
   clock read), tokens/s and MFU (model FLOPs of a step, 3x the forward of
   the graphs, over the step time and the device's dense peak of the plan's
   dtype) of ptc, eager PyTorch, `torch.compile` of the eager model, and ptc
   with `runtime.compile = true`; the ratios of each to eager and to compiled.
3. Memory. The bytes ptc's Trainer holds (params, grads, optimizer state)
   against `Program.state_bytes()` and against `ptc.estimate(plan)`'s
   weights / grads / optimizer terms, and on CUDA the peak allocation
   (`torch.cuda.max_memory_allocated`, reset before the run) against the
   estimate's predicted peak (with and without its fixed runtime reserve).
4. With two or more GPUs: the tiny plan at tp 2, pp 2 and dp 2 ZeRO-3 through
   `ptc.run` on NCCL and on gloo; the losses must agree. Otherwise skipped,
   with the reason, in the JSON and the table.

Everything lands in one JSON file (`--out`): device, torch and CUDA
versions, each run's losses and step times, the memory figures, and each
check's status (pass / fail / skip / error). Exit code 0 when no check
failed or errored, else 1.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

TINY_PLAN = ROOT / "examples" / "tiny_gpt_cpu.ptc"

LOSS_ULPS = 4
"""bf16 losses may differ by this many bf16 ulps of the loss (K = 4 as in tests/tolerances.py:
2 for the two runs' own rounding, 2 for the spread of their sizes)."""
FP32_LOSS_RTOL = 1e-4
"""fp32 losses may differ by this relative amount (see `loss_tolerance`)."""
WEIGHTS_RTOL = 0.05
"""Trained weights: ||ptc - eager|| at most this fraction of ||eager - initial|| (see
`compare_weights`)."""
STATE_RTOL = 0.01
"""Held model-state bytes against a prediction: 1 % (padding, step counters)."""
ESTIMATE_RTOL = 0.10
"""Held model-state bytes against the estimate's terms, per term: 10 %."""
PEAK_LOW = 0.5
"""The predicted peak (less its fixed reserve) may be at most 1 / PEAK_LOW times the measured
peak: a prediction used to refuse plans must not waste half of the memory."""
PEAK_HIGH = 1.0
"""The measured peak may be at most PEAK_HIGH times the predicted peak (reserve included):
an underestimate lets a plan through that then runs out of memory."""
MULTI_STEPS = 5
"""Steps of each multi-GPU run."""


# --------------------------------------------------------------------------- tolerance


def ulp(value: float, bits: int = 8) -> float:
    """Spacing of floats with `bits` significant bits at `value` (bf16: 8, fp16: 11):
    2^(floor(log2|value|) - bits + 1)."""
    if value == 0 or not math.isfinite(value):
        return 0.0
    return 2.0 ** (math.floor(math.log2(abs(value))) - bits + 1)


def bf16_ulp(value: float) -> float:
    """Spacing of bf16 numbers at `value`."""
    return ulp(value, 8)


def loss_tolerance(reference: float, dtype: str) -> float:
    """How far another correct run's loss may be from `reference` (absolute).

    bf16: both runs compute the loss in bf16 (cross-entropy of bf16 logits),
    so each is rounded to bf16's spacing at the loss, 2^-8 .. 2^-7 of it, and
    the weights they compute it from are bf16 roundings of fp32 masters
    whose last bits differ between two correct implementations (the clip
    norm's summation order, kernels): a rounding that flips moves the loss by
    about an ulp. LOSS_ULPS ulps of the loss (at most 4 * 2^-7 = 3 % of it,
    1.6 % to 3 % by where it sits in its binade).

    fp32: the two runs perform the same ops on the same samples; they differ
    in the order of a few sums (the clip norm, accumulation of micro-batch
    gradients), a few fp32 ulps (2^-23) at first, which Adam's normalisation
    can amplify for gradients near zero over the steps. FP32_LOSS_RTOL = 1e-4
    (~840 fp32 ulps) leaves room for that and is still far below what a real
    difference does (another learning rate, a missing clip, a shifted sample
    move the loss by 1e-3 or more within a few steps).
    """
    if dtype == "bf16":
        return LOSS_ULPS * bf16_ulp(reference)
    if dtype == "fp16":
        return LOSS_ULPS * ulp(reference, 11)
    return FP32_LOSS_RTOL * abs(reference)


def compare_losses(reference: list[float], other: list[float], dtype: str) -> dict:
    """Step-by-step comparison: passed, the largest difference and its tolerance."""
    if len(reference) != len(other) or not reference:
        return {"passed": False, "detail": f"{len(reference)} reference losses, "
                                          f"{len(other)} to compare"}
    diffs = [abs(a - b) for a, b in zip(reference, other)]
    tols = [loss_tolerance(r, dtype) for r in reference]
    finite = all(math.isfinite(x) for x in (*reference, *other))
    worst = max(range(len(diffs)), key=lambda i: diffs[i] / tols[i] if tols[i] else (
        math.inf if diffs[i] else 0.0))
    passed = finite and all(d <= t for d, t in zip(diffs, tols))
    return {"passed": passed, "max_abs_diff": max(diffs), "worst_step": worst + 1,
            "worst_diff": diffs[worst], "worst_tol": tols[worst], "diffs": diffs,
            "detail": f"max |d| {max(diffs):.3g}; step {worst + 1}: {diffs[worst]:.3g} vs tol "
                      f"{tols[worst]:.3g} ({dtype})" + ("" if finite else "; non-finite loss")}


def compare_weights(ptc_state: dict, eager_state: dict, initial: dict) -> dict:
    """How far apart the two trainings' weights are, relative to how far training moved them:
    r = ||w_ptc - w_eager|| / ||w_eager - w_0|| over all parameters (fp32 masters).

    Losses are a weak witness in bf16 (4 ulps of a loss of 10 is 0.25) and for
    few steps; the weights are a strong one. AdamW normalises each update by the
    gradient's own RMS, so the last-bit differences of two correct runs (the
    clip factor's summation order) barely move the updates, and the bf16 weights
    both runs compute with, rounded from nearly equal masters, are almost always
    the same numbers: r stays far below 1 % (~3e-7 on the CPU, where ptc and
    eager compute the same bits but the clip factor). A real difference — another learning rate at a
    step, another sample, a lost gradient — changes updates by a sizeable part of
    their size, r of 10 % to 100 % and more. WEIGHTS_RTOL = 5 % sits between.
    """
    missing = [n for n in eager_state if n not in ptc_state]
    if missing:
        return {"passed": False, "detail": f"ptc's state lacks {missing[:3]}"}
    moved = apart = 0.0
    for name, eager in eager_state.items():
        apart += float(torch.linalg.vector_norm(ptc_state[name] - eager, dtype=torch.float64)) ** 2
        moved += float(torch.linalg.vector_norm(eager - initial[name].detach().float(),
                                                dtype=torch.float64)) ** 2
    ratio = math.sqrt(apart) / math.sqrt(moved) if moved else math.inf
    return {"passed": ratio <= WEIGHTS_RTOL, "ratio": ratio, "tol": WEIGHTS_RTOL,
            "detail": f"||ptc - eager|| / ||eager - initial|| = {ratio:.3g} (tol {WEIGHTS_RTOL})"}


# --------------------------------------------------------------------------- report


class Report:
    """The JSON document, the checks, and the guard that keeps one failure from stopping all."""

    def __init__(self, out: Path, *, budget: float = math.inf, compile_reserve: float = 0.0,
                 multi_reserve: float = 0.0):
        """`budget`: seconds the whole check may take; an optional part that would need more
        than what is left (`compile_reserve` for a compiled run, `multi_reserve` for one
        multi-process run) is skipped, saying so."""
        self.out = out
        self.start = time.perf_counter()
        self.budget, self.compile_reserve, self.multi_reserve = \
            budget, compile_reserve, multi_reserve
        self.data: dict = {"env": {}, "config": {}, "runs": {}, "memory": {}, "multi_gpu": {},
                           "checks": [], "errors": []}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def budget_left(self) -> float:
        return self.budget - self.elapsed()

    def check(self, name: str, status: str, detail: str = "", **extra) -> None:
        """Record a check: status is "pass", "fail", "skip" or "error"."""
        self.data["checks"].append({"name": name, "status": status, "detail": detail, **extra})

    def checked(self, name: str, passed: bool, detail: str, **extra) -> None:
        self.check(name, "pass" if passed else "fail", detail, **extra)

    @contextlib.contextmanager
    def guard(self, part: str, *checks: str):
        """Run a part; an exception is recorded (its line, a short traceback) and swallowed.
        `checks` are the checks the part would have made: each is recorded as an error."""
        try:
            yield
        except BaseException as exc:  # noqa: BLE001 - one part's failure must not stop the rest
            if isinstance(exc, KeyboardInterrupt):
                raise
            line = error_line(exc)
            self.data["errors"].append({"part": part, "error": line,
                                        "traceback": traceback.format_exc()[-4000:]})
            print(f"[gpu_check] {part}: {line}", flush=True)
            for name in checks:
                self.check(name, "error", f"{part}: {line}")
        finally:
            cleanup()

    def finish(self) -> bool:
        """Decide the verdict and write the JSON file; True when no check failed or errored."""
        self.data = _finite(self.data)
        statuses = [c["status"] for c in self.data["checks"]]
        passed = bool(statuses) and not any(s in ("fail", "error") for s in statuses)
        self.data["passed"] = passed
        self.data["elapsed_s"] = self.elapsed()
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(json.dumps(self.data, indent=1, default=_json_default,
                                           allow_nan=False) + "\n")
        except (OSError, TypeError, ValueError) as exc:
            print(f"[gpu_check] cannot write {self.out}: {error_line(exc)}", flush=True)
            return False
        return passed


def _json_default(value):
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, torch.dtype):
        return str(value)
    return repr(value)


def _finite(value):
    """JSON has no NaN or Inf: such numbers are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def error_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


def cleanup() -> None:
    """Free what the last part left: Python cycles (the Trainer has some), CUDA cache.
    Never raises: after a CUDA error the synchronisation itself may fail."""
    gc.collect()
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001
            print(f"[gpu_check] cleanup: {error_line(exc)}", flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- plans


def preset_for(device: torch.device) -> tuple[str, str]:
    """The hardware preset of `device` and a note (empty when the preset is the device's)."""
    if device.type != "cuda":
        return "cpu", ""
    name = torch.cuda.get_device_name(device)
    upper = name.upper()
    if "H200" in upper:
        return "H200", ""
    if "B200" in upper:
        return "B200", ""
    if "V100" in upper and torch.cuda.get_device_properties(device).total_memory > 20 * 2**30:
        return "V100-SXM2-32GB", ""
    if "H100" in upper:
        return "H100-SXM", ""
    if "A100" in upper:
        memory = torch.cuda.get_device_properties(device).total_memory
        return ("A100-80GB" if memory > 50 * 2**30 else "A100-40GB"), ""
    return "H100-SXM", f"no preset for {name}: MFU and estimates use H100-SXM's figures"


def hardware(device: torch.device, gpus: int = 1):
    from ptc.plan import HardwareSpec

    return HardwareSpec.preset(preset_for(device)[0], gpus_per_node=gpus)


def tiny_plan(device: torch.device, steps: int):
    """The tiny example plan on one process (tp = pp = dp = 1), hardware of `device`."""
    from ptc.dsl import load_plan

    plan = load_plan(TINY_PLAN, overrides={"parallel.dp": 1, "hardware.gpus_per_node": 1,
                                           "train.steps": steps})
    return dataclasses.replace(
        plan, hardware=hardware(device),
        runtime=dataclasses.replace(plan.runtime, metrics=None, backend="auto"))


def llama_plan(device: torch.device, steps: int, small: bool):
    """The Llama of the check: ~1.1B in bf16 on a GPU, a 2-layer one when `small`."""
    from ptc.plan import (DataSpec, InitSpec, LRScheduleSpec, ModelSpec, OptimizerSpec,
                          ParallelSpec, Plan, RuntimeSpec, TrainSpec)

    if small:
        model = ModelSpec(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=256,
                          vocab=512, max_seq=64)
        seq, micro, batch, lr = 64, 2, 4, 3e-3  # its loss moves visibly in 3 steps
    else:
        model = ModelSpec(family="llama", layers=16, hidden=2048, heads=16, kv_heads=8,
                          ffn=8192, vocab=32000, max_seq=2048)
        seq, micro, batch, lr = 2048, 2, 4, 3e-4
    return Plan(
        model=model, hardware=hardware(device), parallel=ParallelSpec(tp=1, pp=1, dp=1),
        train=TrainSpec(seq_len=seq, global_batch=batch, micro_batch=micro, dtype="bf16",
                        steps=steps, grad_clip=1.0,
                        optimizer=OptimizerSpec(lr=lr, betas=(0.9, 0.95), weight_decay=0.1),
                        lr_schedule=LRScheduleSpec(kind="cosine", warmup=2, min_lr=lr / 10),
                        data=DataSpec(kind="synthetic", seed=1),
                        init=InitSpec(kind="random", seed=0)),
        runtime=RuntimeSpec(backend="auto", seed=0))


def with_compile(plan):
    return dataclasses.replace(plan, runtime=dataclasses.replace(plan.runtime, compile=True))


def describe(plan) -> dict:
    m, t = plan.model, plan.train
    return {"family": m.family, "layers": m.layers, "hidden": m.hidden, "heads": m.heads,
            "kv_heads": getattr(m, "kv_heads", None), "ffn": getattr(m, "ffn", None),
            "vocab": m.vocab, "seq_len": t.seq_len, "micro_batch": t.micro_batch,
            "global_batch": t.global_batch, "dtype": t.dtype, "steps": t.steps,
            "gpu": plan.hardware.gpu, "tp": plan.parallel.tp, "pp": plan.parallel.pp,
            "dp": plan.parallel.dp, "zero": plan.parallel.zero}


# --------------------------------------------------------------------------- runs


def timed_steps(step, steps: int, device: torch.device, warmup: int) -> dict:
    """Run `step(k)` (returning the loss) for k < steps; per-step wall times, synchronised."""
    losses, times = [], []
    for k in range(steps):
        synchronize(device)
        start = time.perf_counter()
        loss = step(k)
        synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    timed = times[warmup:] or times[-1:]
    return {"losses": losses, "step_times": times, "warmup": min(warmup, steps - 1),
            "median_step_s": statistics.median(timed)}


def run_ptc(plan, device: torch.device, warmup: int, *, memory: dict | None = None,
            keep_state: bool = False) -> dict:
    """Train `plan` with ptc's Trainer on `device` (one process); its losses and step times.
    `memory`: filled with held bytes, the predictions and (CUDA) the peak allocation;
    `keep_state`: the trained fp32 weights (CPU) under "state", by the model's names."""
    from ptc.lower.driver import compile_plan
    from ptc.runtime.executor import Trainer
    from ptc.worker import MODELS
    from ptc.runtime.metrics import model_flops_per_step

    program = compile_plan(plan)
    flops = model_flops_per_step(program)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    built = time.perf_counter()
    trainer = Trainer(program, {}, models=MODELS, device=device)
    setup_s = time.perf_counter() - built
    stats = []

    def step(k: int) -> float:
        stats.append(trainer.train_step(k))
        return stats[-1].loss

    try:
        result = timed_steps(step, plan.train.steps, device, warmup)
        result.update(setup_s=setup_s, flops_per_step=flops,
                      trainer_step_times=[s.step_time for s in stats],
                      nonfinite=[list(s.nonfinite) for s in stats if s.nonfinite])
        if memory is not None:
            memory["held"] = trainer.held_bytes()
            memory["program_state_bytes"] = program.state_bytes()
            if device.type == "cuda":
                memory["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        if keep_state:
            result["state"] = trainer.full_state_dict()
        return result
    finally:
        del trainer, program
        if plan.runtime.compile:
            torch._dynamo.reset()


class EagerInputs:
    """What the eager runs of one plan share: the initial model on the CPU (built once:
    ~1.1B normal draws take seconds) and the token source (the toy language is drawn once)."""

    def __init__(self, plan):
        self.plan = plan
        self._model = self._source = None

    def model(self, copy: bool = True):
        """The plan's model with its initial weights, on the CPU, in fp32: a fresh copy to
        train, or (`copy=False`) the shared one, to read."""
        import copy as copying

        from ptc.models import build_model

        if self._model is None:
            self._model = build_model(self.plan.model, device="cpu",
                                      seed=self.plan.train.init.seed)
        return copying.deepcopy(self._model) if copy else self._model

    def source(self):
        from ptc.runtime.data import TokenSource

        if self._source is None:
            train = self.plan.train
            self._source = TokenSource(train.data, vocab=self.plan.model.vocab,
                                       seq_len=train.seq_len)
        return self._source


def run_eager(plan, device: torch.device, warmup: int, *, compiled: bool = False,
              inputs: EagerInputs | None = None, keep_state: bool = False) -> dict:
    """Plain PyTorch training of the plan's model, as ptc's Trainer trains it (tp=pp=dp=1).

    The same initial weights (`build_model` with the plan's init seed: the
    values ptc's init computes), the same samples micro-batch by micro-batch
    (`TokenSource`, `microbatch_start`), each micro-batch's loss scaled by
    1 / micro-batches. bf16: ptc's recipe (the one tests/distributed/dist_helpers.py
    `reference_run` writes): the model in bf16, fp32 master weights; each
    micro-batch's bf16 gradients are added into fp32 master gradients (ptc's
    fp32 main gradients; with `train.grad_dtype` = bf16 they accumulate in bf16
    and are copied once); clip_grad_norm_ and AdamW on the masters; the masters,
    rounded, are the next weights. fp32: the model's own parameters.
    `compiled`: the forward and loss run through `torch.compile`; `keep_state`: the
    trained fp32 weights (CPU) under "state".
    """
    from ptc.runtime.data import microbatch_start
    from ptc.runtime.lr import learning_rate

    train = plan.train
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[train.dtype]
    inputs = inputs or EagerInputs(plan)
    model = inputs.model()
    mixed = dtype != torch.float32
    fp32_grads = getattr(train, "grad_dtype", "fp32") == "fp32"
    names = [n for n, _ in model.named_parameters()]
    masters = {n: torch.nn.Parameter(p.detach().to(device, torch.float32, copy=True))
               for n, p in model.named_parameters()} if mixed else None
    model = model.to(device=device, dtype=dtype)
    params = dict(model.named_parameters())
    trained = masters if mixed else params
    if mixed:
        for p in masters.values():
            p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(list(trained.values()), lr=train.optimizer.lr,
                            betas=train.optimizer.betas, eps=train.optimizer.eps,
                            weight_decay=train.optimizer.weight_decay)
    source = inputs.source()
    micros = train.global_batch // train.micro_batch

    def forward_loss(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = model(tokens)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    loss_of = torch.compile(forward_loss) if compiled else forward_loss

    def step(k: int) -> float:
        total = torch.zeros((), device=device)
        for m in range(micros):
            first = microbatch_start(k, m, dp_rank=0, dp=1, global_batch=train.global_batch,
                                     micro_batch=train.micro_batch)
            tokens, targets = source.batch(first, train.micro_batch)
            loss = loss_of(tokens.to(device), targets.to(device))
            (loss * (1.0 / micros)).backward()
            total += loss.detach().float()
            if mixed and fp32_grads:  # ptc's fp32 main gradients: each micro-batch's added in
                with torch.no_grad():
                    for name in names:
                        masters[name].grad.add_(params[name].grad)
                        params[name].grad = None
        if mixed and not fp32_grads:  # train.grad_dtype = the compute dtype: accumulated there
            with torch.no_grad():
                for name in names:
                    masters[name].grad.copy_(params[name].grad)
                    params[name].grad = None
        if train.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(list(trained.values()), train.grad_clip)
        lr = learning_rate(k, train.optimizer.lr, train.lr_schedule, train.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        with torch.no_grad():
            if mixed:
                for name in names:
                    params[name].copy_(masters[name])
                    masters[name].grad.zero_()
            else:
                opt.zero_grad(set_to_none=False)
        return float(total) / micros

    try:
        result = timed_steps(step, train.steps, device, warmup)
        if keep_state:
            result["state"] = {n: p.detach().to("cpu", torch.float32, copy=True)
                               for n, p in trained.items()}
        return result
    finally:
        del model, params, trained, masters, opt
        if compiled:
            torch._dynamo.reset()


def row_speed(result: dict, plan, peak_flops: float) -> dict:
    """Step time, tokens/s and MFU of one run."""
    step_s = result["median_step_s"]
    tokens = plan.train.global_batch * plan.train.seq_len
    flops = result.get("flops_per_step")
    return {"step_s": step_s, "tokens_per_s": tokens / step_s if step_s else None,
            "mfu": flops / step_s / peak_flops if flops and step_s else None}


def train_model(report: Report, key: str, plan, device: torch.device, *, warmup: int,
                compiled_rows: bool) -> None:
    """ptc against eager (and, with `compiled_rows`, torch.compile and ptc runtime.compile) on
    one plan: losses checked, speeds and memory recorded."""
    import ptc

    runs = report.data["runs"].setdefault(key, {"plan": describe(plan), "rows": {}})
    rows = runs["rows"]
    dtype = plan.train.dtype
    peak = plan.hardware.peak_flops.get(dtype) or plan.hardware.peak_flops.get("fp32")
    runs["peak_flops"] = peak
    estimate = None
    with report.guard(f"{key}.estimate", f"{key}.memory.state_vs_estimate"):
        estimate = ptc.estimate(plan)
        runs["estimate"] = {"step_s": estimate.step_time_s, "mfu": estimate.mfu,
                            "tokens_per_s": estimate.tokens_per_s,
                            "peak_memory_bytes": estimate.peak_memory_bytes}
    memory: dict = {}
    states: dict = {}
    flops = None
    print(f"[gpu_check] {key}: ptc ({report.elapsed():.0f} s)", flush=True)
    with report.guard(f"{key}.ptc", f"{key}.memory.state_vs_program"):
        got = run_ptc(plan, device, warmup, memory=memory, keep_state=True)
        states["ptc"] = got.pop("state")
        flops = got["flops_per_step"]
        rows["ptc"] = {**got, **row_speed(got, plan, peak)}
        _memory_checks(report, key, device, memory, estimate)
    inputs = EagerInputs(plan)
    print(f"[gpu_check] {key}: eager ({report.elapsed():.0f} s)", flush=True)
    with report.guard(f"{key}.eager"):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        got = run_eager(plan, device, warmup, inputs=inputs, keep_state=True)
        states["eager"] = got.pop("state")
        got["flops_per_step"] = flops
        if device.type == "cuda":
            got["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        rows["eager"] = {**got, **row_speed(got, plan, peak)}
    with report.guard(f"{key}.losses"):
        name = f"{key}.losses.ptc_vs_eager"
        if "ptc" in rows and "eager" in rows:
            cmp = compare_losses(rows["eager"]["losses"], rows["ptc"]["losses"], dtype)
            report.checked(name, cmp.pop("passed"), cmp.pop("detail"), **cmp)
        else:
            report.check(name, "error", "no " + " and no ".join(
                r for r in ("ptc", "eager") if r not in rows) + " losses (see errors)")
    with report.guard(f"{key}.weights", f"{key}.weights.ptc_vs_eager"):
        if len(states) == 2:
            cmp = compare_weights(states["ptc"], states["eager"],
                                  dict(inputs.model(copy=False).named_parameters()))
            runs["weights"] = {k: v for k, v in cmp.items() if k != "detail"}
            report.checked(f"{key}.weights.ptc_vs_eager", cmp.pop("passed"), cmp.pop("detail"),
                           **cmp)
        else:
            report.check(f"{key}.weights.ptc_vs_eager", "error", "a run failed (see errors)")
    states.clear()
    for row, label in (("eager_compiled", "torch.compile"), ("ptc_compiled", "ptc compile")):
        if not compiled_rows:
            break
        check = f"{key}.losses.{row}_vs_eager"
        left = report.budget_left()
        if left < report.compile_reserve:
            reason = f"time budget: {left:.0f} s left, a compiled run needs ~" \
                     f"{report.compile_reserve:.0f} s"
            rows[row] = {"skipped": reason}
            report.check(check, "skip", reason)
            continue
        print(f"[gpu_check] {key}: {label} ({report.elapsed():.0f} s)", flush=True)
        with report.guard(f"{key}.{row}", check):
            # One more warm-up step: the first compiles, the second may still recompile.
            if row == "eager_compiled":
                got = run_eager(plan, device, warmup + 1, compiled=True, inputs=inputs)
                got["flops_per_step"] = flops
            else:
                got = run_ptc(with_compile(plan), device, warmup + 1)
            rows[row] = {**got, **row_speed(got, plan, peak)}
            if "eager" in rows:
                cmp = compare_losses(rows["eager"]["losses"], got["losses"], dtype)
                report.checked(check, cmp.pop("passed"), cmp.pop("detail"), **cmp)
            else:
                report.check(check, "error", "no eager losses to compare with")
    del inputs
    _ratios(rows)


def _ratios(rows: dict) -> None:
    eager = rows.get("eager", {}).get("step_s")
    compiled = rows.get("eager_compiled", {}).get("step_s")
    for row in rows.values():
        step = row.get("step_s")
        if step:
            row["vs_eager"] = step / eager if eager else None
            row["vs_compiled"] = step / compiled if compiled else None


def _memory_checks(report: Report, key: str, device: torch.device, memory: dict,
                   estimate) -> None:
    """Held bytes against Program.state_bytes() and the estimate's terms; CUDA peak against
    the estimate's peak."""
    from ptc.plan import CPU_PROCESS_BYTES, GPU_RUNTIME_RESERVE

    reserve = GPU_RUNTIME_RESERVE if device.type == "cuda" else CPU_PROCESS_BYTES
    report.data["memory"][key] = memory
    held, program = memory["held"], memory["program_state_bytes"]
    bad = [k for k in held if abs(held[k] - program[k]) > STATE_RTOL * max(program[k], 1)]
    report.checked(f"{key}.memory.state_vs_program", not bad,
                   "held bytes = Program.state_bytes()" if not bad else "differ: " + ", ".join(
                       f"{k} held {held[k]} predicted {program[k]}" for k in bad))
    if estimate is None:
        return  # the estimate failed: its error and check are recorded already
    terms = dict(estimate.memory_terms[0])
    memory["estimate_terms"] = terms
    memory["estimate_peak_bytes"] = estimate.peak_memory_bytes
    memory["estimate_reserve_bytes"] = reserve
    pairs = {"params": "weights", "grads": "grads", "optimizer": "optimizer"}
    ratios = {k: held[k] / terms[t] if terms[t] else None for k, t in pairs.items()}
    memory["held_over_estimate"] = ratios
    off = [f"{k} {held[k] / 2**20:.1f} MiB held vs {terms[t] / 2**20:.1f} MiB estimated"
           + (f" ({ratios[k]:.2f}x)" if ratios[k] is not None else "")
           for k, t in pairs.items() if ratios[k] is None or abs(ratios[k] - 1) > ESTIMATE_RTOL]
    report.checked(f"{key}.memory.state_vs_estimate", not off,
                   "; ".join(off) if off else "params, grads, optimizer within "
                   f"{ESTIMATE_RTOL:.0%} of the estimate's terms", ratios=ratios)
    name = f"{key}.memory.peak_vs_estimate"
    if device.type != "cuda":
        report.check(name, "skip", "no CUDA: the peak allocation is measured on GPUs only")
        return
    peak = memory["cuda_peak_bytes"]
    predicted = estimate.peak_memory_bytes
    modelled = predicted - reserve
    memory["peak_over_estimate"] = peak / predicted
    memory["peak_over_estimate_less_reserve"] = peak / modelled if modelled > 0 else None
    ok = peak <= PEAK_HIGH * predicted and modelled <= peak / PEAK_LOW
    report.checked(name, ok, f"measured {peak / 2**30:.2f} GiB, predicted "
                   f"{predicted / 2**30:.2f} GiB ({modelled / 2**30:.2f} GiB less the "
                   f"{reserve / 2**30:.0f} GiB reserve)")


# --------------------------------------------------------------------------- multi-GPU


def multi_plans(device_kind: str, steps: int) -> dict:
    """The tiny plan at tp 2, pp 2 and dp 2 ZeRO-3 on two processes (hardware of the GPUs)."""
    from ptc.dsl import load_plan

    preset = "cpu" if device_kind == "cpu" else preset_for(torch.device("cuda", 0))[0]
    layouts = {"tp2": {"parallel.tp": 2, "parallel.dp": 1},
               "pp2": {"parallel.pp": 2, "parallel.dp": 1},
               "dp2_zero3": {"parallel.dp": 2, "parallel.zero": 3}}
    plans = {}
    for name, axes in layouts.items():
        plan = load_plan(TINY_PLAN, overrides={**axes, "hardware.gpus_per_node": 2,
                                               "train.steps": steps})
        from ptc.plan import HardwareSpec

        plans[name] = dataclasses.replace(
            plan, hardware=HardwareSpec.preset(preset, gpus_per_node=2),
            runtime=dataclasses.replace(plan.runtime, metrics=None, log_every=steps))
    return plans


def multi_gpu(report: Report, backends: tuple[str, str], device_kind: str) -> None:
    """Each layout through `ptc.run` on both backends; the losses must agree (fp32)."""
    import ptc

    os.environ.setdefault("PTC_TIMEOUT", "120")  # a hung collective fails instead of hanging
    section = report.data["multi_gpu"]
    section.update(status="ran", backends=list(backends), runs={})
    first, second = backends
    for name, plan in multi_plans(device_kind, MULTI_STEPS).items():
        losses = []
        check = f"multi_gpu.{name}.{first}_vs_{second}"
        for index, backend in enumerate(backends):
            label = f"{name}.{backend}" + (f"#{index + 1}" if first == second else "")
            if report.budget_left() < report.multi_reserve:
                break
            print(f"[gpu_check] multi-GPU {label} ({report.elapsed():.0f} s)", flush=True)
            with report.guard(f"multi_gpu.{label}"):
                start = time.perf_counter()
                result = ptc.run(dataclasses.replace(
                    plan, runtime=dataclasses.replace(plan.runtime, backend=backend)))
                losses.append(result.losses)
                section["runs"][label] = {
                    "losses": result.losses, "wall_s": time.perf_counter() - start,
                    "step_times": [s.step_time for s in result.steps]}
        if len(losses) == 2:
            cmp = compare_losses(losses[1], losses[0], plan.train.dtype)
            report.checked(check, cmp.pop("passed"), cmp.pop("detail"), **cmp)
        elif report.budget_left() < report.multi_reserve:
            report.check(check, "skip", f"time budget: {report.budget_left():.0f} s left")
        else:
            report.check(check, "error", "a run failed (see errors)")


# --------------------------------------------------------------------------- output


def environment(device: torch.device) -> dict:
    env = {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
           "python": platform.python_version(), "host": platform.node(),
           "cpu_threads": torch.get_num_threads()}
    preset, note = preset_for(device)
    env["preset"] = preset
    if note:
        env["preset_note"] = note
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, device_memory_bytes=props.total_memory,
                   capability=f"{props.major}.{props.minor}",
                   cudnn=torch.backends.cudnn.version(),
                   tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
                   nccl=".".join(map(str, torch.cuda.nccl.version()))
                   if hasattr(torch.cuda, "nccl") else None)
    else:
        env["device_name"] = platform.processor() or platform.machine() or "cpu"
    return env


ROW_LABELS = {"ptc": "ptc", "eager": "eager torch", "eager_compiled": "torch.compile",
              "ptc_compiled": "ptc runtime.compile"}


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    """`value * scale` formatted, or "-" when there is none."""
    return "-" if value is None else format(value * scale, spec)


MIB = 1.0 / 2**20


def table(data: dict) -> str:
    """The printed summary of the JSON document."""
    env = data["env"]
    lines = [f"gpu_check: {env.get('device_name')} ({env.get('device')}), "
             f"{env.get('cuda_devices')} CUDA device(s), torch {env.get('torch')}, "
             f"CUDA {env.get('cuda')}, preset {env.get('preset')}", "",
             f"{'model':10s} {'run':20s} {'step ms':>9s} {'tokens/s':>10s} {'MFU %':>7s} "
             f"{'/eager':>7s} {'/compiled':>9s}  loss first -> last"]
    for key, runs in data["runs"].items():
        plan, head = runs["plan"], key
        for row, label in ROW_LABELS.items():
            got = runs["rows"].get(row)
            if got is None:
                continue
            if "skipped" in got:
                lines.append(f"{head:10s} {label:20s} skipped: {got['skipped']}")
            else:
                losses = got.get("losses") or []
                lines.append(
                    f"{head:10s} {label:20s} {_fmt(got.get('step_s'), '9.2f', 1e3):>9s} "
                    f"{_fmt(got.get('tokens_per_s'), '10.0f'):>10s} "
                    f"{_fmt(got.get('mfu'), '7.2f', 100):>7s} "
                    f"{_fmt(got.get('vs_eager'), '7.2f'):>7s} "
                    f"{_fmt(got.get('vs_compiled'), '9.2f'):>9s}  "
                    + (f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else ""))
            head = ""
        lines.append(f"{'':10s} ({plan['family']} {plan['layers']}x{plan['hidden']}, seq "
                     f"{plan['seq_len']}, batch {plan['global_batch']}/{plan['micro_batch']}, "
                     f"{plan['dtype']}, {plan['steps']} steps, {plan['gpu']} figures)")
        est = runs.get("estimate")
        if est:
            lines.append(f"{'':10s} ptc.estimate: {est['step_s'] * 1e3:.2f} ms/step, "
                         f"{est['tokens_per_s']:.0f} tokens/s, MFU {est['mfu'] * 100:.2f}%")
    for key, mem in data["memory"].items():
        held, est = mem.get("held", {}), mem.get("estimate_terms", {})
        prog = mem.get("program_state_bytes", {})
        lines += ["", f"{'memory ' + key + ' (MiB)':30s} {'held':>10s} {'program':>10s} "
                      f"{'estimate':>10s}"]
        for k, t in (("params", "weights"), ("grads", "grads"), ("optimizer", "optimizer")):
            lines.append(f"  {k:28s} {_fmt(held.get(k), '10.2f', MIB):>10s} "
                         f"{_fmt(prog.get(k), '10.2f', MIB):>10s} "
                         f"{_fmt(est.get(t), '10.2f', MIB):>10s}")
        if "cuda_peak_bytes" in mem:
            reserve = mem.get("estimate_reserve_bytes") or 0
            predicted = mem.get("estimate_peak_bytes")
            peak = _fmt(mem["cuda_peak_bytes"], "10.1f", MIB)
            lines.append(f"  {'CUDA peak (ptc)':28s} {peak:>10s} "
                         f"{'':>10s} {_fmt(predicted, '10.1f', MIB):>10s}  (estimate incl. "
                         f"{reserve * MIB:.0f} MiB runtime reserve)")
            eager = data["runs"].get(key, {}).get("rows", {}).get("eager", {})
            if eager.get("cuda_peak_bytes"):
                lines.append(f"  {'CUDA peak (eager torch)':28s} "
                             f"{_fmt(eager['cuda_peak_bytes'], '10.1f', MIB):>10s}")
        else:
            lines.append(f"  {'CUDA peak':28s} skipped: no CUDA device")
    multi = data["multi_gpu"]
    lines.append("")
    if multi.get("status") == "skipped":
        lines.append(f"multi-GPU: skipped: {multi.get('reason')}")
    elif not multi:
        lines.append("multi-GPU: did not run (see the errors below)")
    else:
        lines.append(f"multi-GPU ({' vs '.join(multi.get('backends', []))}, "
                     f"{MULTI_STEPS} steps each):")
        for name, run in multi.get("runs", {}).items():
            losses = run["losses"]
            lines.append(f"  {name:22s} loss {losses[0]:.5f} -> {losses[-1]:.5f} "
                         f"({run['wall_s']:.0f} s with start-up)")
    lines.append("")
    for c in data["checks"]:
        lines.append(f"  {c['status'].upper():5s} {c['name']}: {c['detail']}")
    for e in data["errors"]:
        lines.append(f"  error in {e['part']}: {e['error']}")
    lines += ["", f"{'PASSED' if data.get('passed') else 'FAILED'} in "
                  f"{data.get('elapsed_s', 0):.0f} s; JSON: {data['config'].get('out')}"]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json", help="the JSON file to write")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps per run (default: 8 on CUDA, 3 on the CPU)")
    parser.add_argument("--quick", action="store_true",
                        help="smallest sizes everywhere (a 2-layer Llama even on a GPU), 3 steps")
    parser.add_argument("--skip-1b", action="store_true", help="leave out the Llama runs")
    parser.add_argument("--no-compile", action="store_true",
                        help="leave out the torch.compile and runtime.compile rows")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds the whole check may take; later optional parts (compiled "
                             "rows, multi-GPU runs) are skipped when too little is left "
                             "(default: 230 on CUDA, unlimited on the CPU)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default on the CPU: 1, so that a shared "
                             "machine's oversubscription does not wreck the timings)")
    # A CPU smoke test of part 4: the multi-process runs on gloo against gloo.
    parser.add_argument("--multi-cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 3:
        parser.error("--steps must be at least 3 (warm-up steps are not timed)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    threads = args.threads if args.threads is not None else (None if cuda else 1)
    if threads:
        torch.set_num_threads(threads)
    steps = args.steps or (3 if args.quick or not cuda else 8)
    small = args.quick or not cuda
    budget = args.budget if args.budget is not None else (230.0 if cuda else math.inf)
    # A compiled 1B run (inductor, forward and backward) takes about a minute on a GPU host.
    report = Report(Path(args.out), budget=budget,
                    compile_reserve=60.0 if cuda and not small else 0.0, multi_reserve=20.0)
    report.data["config"] = {"out": str(args.out), "steps": steps, "quick": args.quick,
                             "small": small, "skip_1b": args.skip_1b,
                             "compile": not args.no_compile, "budget_s": budget
                             if math.isfinite(budget) else None,
                             "loss_ulps_bf16": LOSS_ULPS, "loss_rtol_fp32": FP32_LOSS_RTOL}
    with report.guard("environment"):
        report.data["env"] = environment(device)
    warmup = 1

    with report.guard("tiny_gpt", "tiny_gpt.losses.ptc_vs_eager"):
        plan = tiny_plan(device, steps)
        train_model(report, "tiny_gpt", plan, device, warmup=warmup, compiled_rows=False)
    if args.skip_1b:
        report.check("llama.losses.ptc_vs_eager", "skip", "--skip-1b")
    else:
        key = "llama" if small else "llama_1b"
        with report.guard(key, f"{key}.losses.ptc_vs_eager"):
            plan = llama_plan(device, steps, small)
            train_model(report, key, plan, device, warmup=warmup,
                        compiled_rows=not args.no_compile)

    gpus = torch.cuda.device_count() if cuda else 0
    if args.multi_cpu_smoke:
        with report.guard("multi_gpu", "multi_gpu"):
            multi_gpu(report, ("gloo", "gloo"), "cpu")
    elif gpus >= 2:
        with report.guard("multi_gpu", "multi_gpu"):
            multi_gpu(report, ("nccl", "gloo"), "cuda")
    else:
        reason = f"needs 2 or more CUDA devices, found {gpus}"
        report.data["multi_gpu"] = {"status": "skipped", "reason": reason}
        report.check("multi_gpu", "skip", reason)

    passed = report.finish()
    print(table(report.data), flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
