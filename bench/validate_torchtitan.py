"""Score ptc's cost model on torchtitan's published runs: Llama 3.1 on H100 and H200.

`bench/validate_cost_model.py` scores the runs the presets' `achievable_fraction` is
solved from; `bench/validate_out_of_sample.py` and `bench/validate_held_out.py` score
Megatron-style runs outside them. This script scores the same mechanisms, unchanged,
on the tables the pytorch/torchtitan repository publishes (read at commit
b5bcd76c66d0acb1a08b176d9639425bc55e0b2a):
- benchmarks/llama3_h100_202412_torchtitan.md ("T24", Tables 1-6; the same tables
  were docs/performance.md up to commit d4c86e375): Llama 3.1 8B, 70B and 405B on 8
  to 512 H100s, FSDP, CP, TP, PP, torch.compile, Float8, async TP; tokens per second
  per GPU and peak memory, torchtitan 9dec370, December 2024;
- benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md ("A25"): 70B on 256 and 8B on
  64 H100s, FSDP x TP 8, vanilla against async TP in bfloat16, float8 tensorwise and
  float8 rowwise; tokens per second (per GPU: its 70B float8 vanilla-TP row, 809.8,
  is T24's Table 4 layout, 829 per GPU), torchtitan 820504e, June 2025;
- benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md ("W25"): 8B on 32 and 64
  H200s, FSDP, torch.compile, float8; tokens per second per GPU and memory,
  torchtitan e7c0cae, June 2025.
The torchtitan paper (Liang et al., ICLR 2025) reports the same kind of tables; their
text was not available to read, and no figure of it is used.

Every row is built by the same rules:
- model: Llama 3.1 shapes as torchtitan's model args give them (8B: 32 layers, dim
  4096, 32 heads, ffn 14336; 70B: 80, 8192, 64, 28672; 405B: 126, 16384, 128, 53248),
  8 key/value heads, vocab 128256, untied embeddings, no dropout, flash attention;
- sequence length: the table's, else the model's train config at the run's torchtitan
  commit (train_configs/llama3_*.toml: 8192 for all three);
- batch: torchtitan's local batch is per data-parallel rank; global batch = local
  batch x FSDP degree (CP ranks share a sequence); without PP the local batch is one
  micro-batch; with PP it is cut into torchtitan's default number of micro-batches,
  the PP degree;
- FSDP -> ZeRO-3 over the data-parallel ranks; TP -> tp with sequence parallelism
  (torchtitan's TP plan shards the norms along the sequence); async TP ->
  `parallel.tp_comm = async`, else `sync`; CP -> cp; communication overlapped;
- PP: "1F1B" -> 1f1b; "Interleaved 1F1B" -> interleaved with torchtitan's default of
  2 stages per rank; the cut is torchtitan's generated split (generate_split_points at
  9dec370: the first stage holds layers // stages, the next stages one more each while
  layers % stages last, the last stage the rest), pinned as `stage_boundaries`;
- activation checkpointing: "full" -> full; "selective" (torchtitan's default option
  "op") and "per op SAC" -> ops (ptc keeps every matmul output; torchtitan recomputes
  every second mm);
- Float8 -> `train.dtype = fp8`, recipe tensorwise unless the table says rowwise,
  scaled current (torchao's dynamic scaling, torchtitan's default); torchtitan leaves
  the output projection in bf16, as ptc's fp8 does;
- torch.compile -> `runtime.compile = true`;
- attention: torchtitan's SDPA asks for the flash backend first on Hopper
  (torchtitan/models/attention.py; cuDNN's only on Blackwell, pull request
  1196), and PyTorch leaves cuDNN's opt-in there since its 2.5 bugs
  (pytorch/pytorch#138522): FlashAttention-2's kernel. Its rate is the one
  measured beside cuDNN's in one run on an H100 (pytorch/pytorch#142132,
  December 2024, shape (1, 24, 4608, 128): 329.5 against 631.3 TFLOP/s), as
  a share of the kernel ptc prices at the GEMM rate:
  `attention_fraction` = 329.5 / 631.3 x the preset's `achievable_fraction`;
- hardware: Meta's Grand Teton hosts (T24, A25) are "H100-SXM" with the sources' own
  figures, 96 GB HBM2e at 2.4 TB/s (`hbm_bytes`, `mem_bandwidth`) under the default
  500 W power limit (`power_limit`), 400 Gb/s RDMA per GPU (the preset's 50 GB/s);
  W25's hosts are the "H200" preset (8 GPUs on NVLink, 400 Gb/s per GPU; no power limit
  stated).
Memory is torchtitan's max reserved GiB (the largest over PP ranks); ptc's predicted
peak (`estimate(plan).peak_memory_bytes`) is printed beside it.

Not expressible: torchtitan's MXFP8 dense table (torchtitan/components/quantization/
mxfp8.md) names neither the model nor the power limit of its "power limited B200s",
and its MoE table (Llama 4 Scout) is not scored here (`bench/validate_moe.py` scores
Megatron-Bridge's MoE rows); both are listed with the reason.

It prints each row (measured, predicted, error, the biggest parts of the step and
memory), then the median, p90 and max |error|, the rows within 10 % and 25 %, and the
ordering of pairs as `validate_out_of_sample.py` counts it (pairs of one model on one
system).

Usage: python bench/validate_torchtitan.py
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ptc.compiler.search.estimate import estimate  # noqa: E402
from ptc.compiler.shapes import plan_from_shape  # noqa: E402
from ptc.plan import Plan  # noqa: E402
from ptc.presets import PRESETS  # noqa: E402
from ptc.units import UNITS  # noqa: E402
from validate_cost_model import error_summary  # noqa: E402
from validate_out_of_sample import LLAMA3, pair_order  # noqa: E402

GiB = UNITS["GiB"][1]

SEQ = 8192
"""The sequence length of torchtitan's Llama 3 train configs (8B, 70B and 405B alike)."""

FLASH2_OVER_CUDNN = 329.483 / 631.338
"""FlashAttention-2's (SDPA's flash backend) rate over cuDNN's fused attention kernel on an
H100, measured in one tritonbench run (pytorch/pytorch#142132)."""

SYSTEMS = {
    "GrandTeton": dict(gpu="H100-SXM", hbm_bytes=96 * 10**9, mem_bandwidth=2.4 * 10**12,
                       power_limit=500.0),
    "H200": dict(gpu="H200"),
}
"""A row's system -> preset and the fields its source states otherwise (module docstring)."""

RUNS = [  # source, model, system, GPUs, FSDP, TP, PP, CP, seq, local batch, schedule,
    #          AC, compile, precision, async TP, tokens/s/GPU, memory GiB
    # T24 Table 1: 8B, 8 GPUs, local batch 2, selective AC.
    ("T24.1", "8B", "GrandTeton", 8, 8, 1, 1, 1, SEQ, 2, "", "ops", False, "bf16", False,
     5762, 82.4),
    ("T24.1", "8B", "GrandTeton", 8, 8, 1, 1, 1, SEQ, 2, "", "ops", True, "bf16", False,
     6667, 77.0),
    ("T24.1", "8B", "GrandTeton", 8, 8, 1, 1, 1, SEQ, 2, "", "ops", True, "tensorwise", False,
     8532, 76.8),
    # T24 Table 2: 8B, 8 GPUs, FSDP + CP + compile + Float8, local batch 1, full AC.
    ("T24.2", "8B", "GrandTeton", 8, 8, 1, 1, 1, 32768, 1, "", "full", True, "tensorwise",
     False, 3890, 83.9),
    ("T24.2", "8B", "GrandTeton", 8, 4, 1, 1, 2, 65536, 1, "", "full", True, "tensorwise",
     False, 2540, 84.2),
    ("T24.2", "8B", "GrandTeton", 8, 2, 1, 1, 4, 131072, 1, "", "full", True, "tensorwise",
     False, 1071, 84.0),
    ("T24.2", "8B", "GrandTeton", 8, 1, 1, 1, 8, 262144, 1, "", "full", True, "tensorwise",
     False, 548, 84.5),
    # T24 Table 3: 8B, 128 GPUs, local batch 2, selective AC.
    ("T24.3", "8B", "GrandTeton", 128, 128, 1, 1, 1, SEQ, 2, "", "ops", False, "bf16", False,
     5605, 67.0),
    ("T24.3", "8B", "GrandTeton", 128, 128, 1, 1, 1, SEQ, 2, "", "ops", True, "bf16", False,
     6514, 62.0),
    ("T24.3", "8B", "GrandTeton", 128, 128, 1, 1, 1, SEQ, 2, "", "ops", True, "tensorwise",
     False, 8380, 61.8),
    # T24 Table 4: 70B, 256 GPUs, FSDP 32 x TP 8, compile + Float8, local batch 16, full AC.
    ("T24.4", "70B", "GrandTeton", 256, 32, 8, 1, 1, SEQ, 16, "", "full", True, "tensorwise",
     False, 829, 71.9),
    ("T24.4", "70B", "GrandTeton", 256, 32, 8, 1, 1, SEQ, 16, "", "full", True, "tensorwise",
     True, 876, 67.6),
    # T24 Table 5: 405B, 512 GPUs, FSDP 8 x TP 8 x PP 8, compile + Float8 + async TP, local
    # batch 32, full AC.
    ("T24.5", "405B", "GrandTeton", 512, 8, 8, 8, 1, SEQ, 32, "1F1B", "full", True,
     "tensorwise", True, 100, 82.5),
    ("T24.5", "405B", "GrandTeton", 512, 8, 8, 8, 1, SEQ, 32, "Interleaved 1F1B", "full",
     True, "tensorwise", True, 128, 72.7),
    # T24 Table 6: 405B, 512 GPUs, TP 8 x PP 8, FSDP x CP = 8, compile + Float8 + async TP,
    # 1F1B, local batch 8, full AC.
    ("T24.6", "405B", "GrandTeton", 512, 8, 8, 8, 1, 32768, 8, "1F1B", "full", True,
     "tensorwise", True, 76, 75.3),
    ("T24.6", "405B", "GrandTeton", 512, 4, 8, 8, 2, 65536, 8, "1F1B", "full", True,
     "tensorwise", True, 47, 75.9),
    ("T24.6", "405B", "GrandTeton", 512, 2, 8, 8, 4, 131072, 8, "1F1B", "full", True,
     "tensorwise", True, 31, 77.1),
    ("T24.6", "405B", "GrandTeton", 512, 1, 8, 8, 8, 262144, 8, "1F1B", "full", True,
     "tensorwise", True, 16, 84.9),
    # A25: 70B, 256 GPUs, FSDP 32 x TP 8, compile, full AC, local batch 16.
    ("A25", "70B", "GrandTeton", 256, 32, 8, 1, 1, SEQ, 16, "", "full", True, "bf16", False,
     597.3, None),
    ("A25", "70B", "GrandTeton", 256, 32, 8, 1, 1, SEQ, 16, "", "full", True, "bf16", True,
     652.4, None),
    ("A25", "70B", "GrandTeton", 256, 32, 8, 1, 1, SEQ, 16, "", "full", True, "tensorwise",
     False, 809.8, None),
    ("A25", "70B", "GrandTeton", 256, 32, 8, 1, 1, SEQ, 16, "", "full", True, "tensorwise",
     True, 942.4, None),
    ("A25", "70B", "GrandTeton", 256, 32, 8, 1, 1, SEQ, 16, "", "full", True, "rowwise",
     False, 599.6, None),
    ("A25", "70B", "GrandTeton", 256, 32, 8, 1, 1, SEQ, 16, "", "full", True, "rowwise",
     True, 624.8, None),
    # A25: 8B, 64 GPUs, FSDP 8 x TP 8, compile, per op SAC, local batch 12.
    ("A25", "8B", "GrandTeton", 64, 8, 8, 1, 1, SEQ, 12, "", "ops", True, "bf16", False,
     4378, None),
    ("A25", "8B", "GrandTeton", 64, 8, 8, 1, 1, SEQ, 12, "", "ops", True, "bf16", True,
     4809.4, None),
    ("A25", "8B", "GrandTeton", 64, 8, 8, 1, 1, SEQ, 12, "", "ops", True, "tensorwise", False,
     5078.1, None),
    ("A25", "8B", "GrandTeton", 64, 8, 8, 1, 1, SEQ, 12, "", "ops", True, "tensorwise", True,
     5570.1, None),
    ("A25", "8B", "GrandTeton", 64, 8, 8, 1, 1, SEQ, 12, "", "ops", True, "rowwise", False,
     3708.5, None),
    ("A25", "8B", "GrandTeton", 64, 8, 8, 1, 1, SEQ, 12, "", "ops", True, "rowwise", True,
     3914.9, None),
    # W25: 8B on 4 and 8 H200 hosts, FSDP, local batch 2, compile, float8 tensorwise, the
    # train config's selective (op) AC.
    ("W25", "8B", "H200", 32, 32, 1, 1, 1, SEQ, 2, "", "ops", True, "tensorwise", False,
     10938, 47.96),
    ("W25", "8B", "H200", 64, 64, 1, 1, 1, SEQ, 2, "", "ops", True, "tensorwise", False,
     10753, 46.97),
]
"""torchtitan's published rows (module docstring); memory None where the table gives none."""

NOT_EXPRESSIBLE = [
    ("mxfp8.md dense, 4 rows (bf16, mxfp8_cublas, mxfp8_cublas_rceil, float8 tensorwise; "
     "8 B200)", "the model is not named and the B200s' power limit is not given"),
    ("mxfp8.md MoE, 2 rows (bf16, mxfp8; Llama 4 Scout on 512 GB200)",
     "mixture of experts: not scored here (bench/validate_moe.py scores published MoE runs)"),
]
"""Published torchtitan rows no plan can state, with the reason."""

SCHEDULES = {"": ("1f1b", 1), "1F1B": ("1f1b", 1), "Interleaved 1F1B": ("interleaved", 2)}
"""A table's PP schedule -> ptc's schedule and virtual stages per rank (module docstring)."""


def torchtitan_cut(layers: int, stages: int) -> tuple[str, ...]:
    """Where each of stages 1 .. stages-1 starts, as torchtitan's generate_split_points
    (9dec370) places the cut when no split points are given."""
    base, extra = divmod(layers, stages)
    cuts, layer = [], 0
    for i in range(stages - 1):
        take = base + 1 if i and extra > 0 else base
        extra -= take > base
        layer += take
        cuts.append(f"layers.{layer}")
    return tuple(cuts)


def build(model: str, system: str, gpus: int, fsdp: int, tp: int, pp: int, cp: int, seq: int,
          local_batch: int, schedule: str, ac: str, compiled: bool, precision: str,
          async_tp: bool) -> Plan:
    """The Plan of one row, built by the module docstring's rules."""
    shape = LLAMA3[model]
    kind, v = SCHEDULES[schedule]
    micro = local_batch // pp if pp > 1 else local_batch
    fields = dict(SYSTEMS[system])
    fields["attention_fraction"] = FLASH2_OVER_CUDNN * PRESETS[fields["gpu"]].achievable_fraction
    plan = plan_from_shape(
        family="llama", vocab=128256, kv_heads=8, seq_len=seq, global_batch=local_batch * fsdp,
        gpu=fields.pop("gpu"), num_gpus=gpus, tp=tp, pp=pp, dp=fsdp, cp=cp, micro_batch=micro,
        dtype="bf16" if precision == "bf16" else "fp8", zero=3, sequence_parallel=tp > 1,
        tp_comm="async" if async_tp else "sync", schedule=kind, virtual_stages=v,
        checkpoint=ac, overlap=True, tied_embeddings=False,
        stage_boundaries=torchtitan_cut(shape["layers"], pp * v) if pp > 1 else (), **shape)
    plan = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware, **fields),
                               runtime=dataclasses.replace(plan.runtime, compile=compiled))
    if precision == "bf16":
        return plan
    return dataclasses.replace(plan, train=dataclasses.replace(
        plan.train, fp8_recipe=precision, fp8_scaling="current"))


def score(row: tuple) -> tuple[Plan, object, float]:
    """A row's plan, its estimate and the predicted tokens per second per GPU."""
    _, model, system, gpus, fsdp, tp, pp, cp, seq, batch, schedule, ac, compiled, \
        precision, async_tp, _, _ = row
    plan = build(model, system, gpus, fsdp, tp, pp, cp, seq, batch, schedule, ac, compiled,
                 precision, async_tp)
    est = estimate(plan)
    return plan, est, batch * fsdp * seq / est.step_time_s / gpus


def label(row: tuple) -> str:
    """A row's layout in a few words."""
    _, _, _, _, fsdp, tp, pp, cp, seq, batch, schedule, ac, compiled, precision, \
        async_tp, _, _ = row
    parts = [f"fsdp{fsdp}"] + [f"{n}{d}" for n, d in (("tp", tp), ("pp", pp), ("cp", cp))
                               if d > 1]
    parts += ["atp"] if async_tp else []
    parts += ["ilv"] if schedule.startswith("Interleaved") else []
    parts += [f"s{seq // 1024}k", f"b{batch}", ac, precision[:4]] + (["cmp"] if compiled else [])
    return " ".join(parts)


def main() -> int:
    """Print each row's predicted and measured tokens/s per GPU and memory, then the error
    summaries and how well ptc orders the rows of one model on one system."""
    print(f"{'src':<6}{'model':<5}{'gpus':>5}  {'layout':<44}{'pred':>7}{'meas':>8}{'err':>8}"
          f"{'memP':>7}{'memM':>6}  step parts")
    errors, mem_errors, ranked = [], [], []
    for row in RUNS:
        source, model, system, gpus = row[:4]
        measured, memory = row[-2], row[-1]
        plan, est, predicted = score(row)
        error = (predicted - measured) / measured
        errors.append(error)
        ranked.append(((model, system), plan, predicted, measured))
        mem = est.peak_memory_bytes / GiB
        if memory is not None:
            mem_errors.append((mem - memory) / memory)
        parts = sorted(est.breakdown.items(), key=lambda kv: -kv[1])[:4]
        shown = ", ".join(f"{k} {v / est.step_time_s:.0%}" for k, v in parts)
        print(f"{source:<6}{model:<5}{gpus:>5}  {label(row):<44}{predicted:>7.0f}{measured:>8g}"
              f"{error:>+8.1%}{mem:>7.1f}{memory if memory is not None else '-':>6}  {shown}")
    for what, why in NOT_EXPRESSIBLE:
        print(f"not expressible: {what}: {why}")
    print(f"\n{len(RUNS)} rows scored, {len(NOT_EXPRESSIBLE)} tables not expressible")
    print(f"tokens/s per GPU: {error_summary(errors)}")
    for source in sorted({row[0].split('.')[0] for row in RUNS}):
        errs = [abs(e) for row, e in zip(RUNS, errors) if row[0].split('.')[0] == source]
        print(f"  {source}: {len(errs)} rows, median |error| {statistics.median(errs):.1%}, "
              f"max {max(errs):.1%}")
    print(f"peak memory (ptc's peak against torchtitan's max reserved): "
          f"{error_summary(mem_errors)}")
    print(f"ordering (same model and system): {pair_order(ranked)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
