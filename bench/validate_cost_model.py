"""Score ptc's cost model against published training runs.

Reads `published_runs.csv` (from $PTC_VALIDATION_DIR, else ../shared/validation
beside the repository), builds each run as a Plan from its shape numbers,
predicts the step time with `ptc.compiler.estimate.estimate`, and compares
under the row's own convention:

- rows with an iteration time: predicted vs measured seconds per iteration;
- Narayanan et al. 2021 rows (TFLOP/s via their Eq. 3, recompute counted):
  Eq. 3 FLOPs / predicted time;
- Megatron-LM README 2024 rows (model FLOPs, MFU = TF/s / 989):
  72·B·s·L·h²·(1 + s/6h + V/12Lh) / predicted time.

Defaults for what a row leaves unstated (the same for every row; printed per
row under "assumed"):
- micro_batch 1;
- pipeline rows (pp > 1) use the interleaved schedule with v = the smallest
  divisor >= 2 of the layers per stage when that is <= 8, else plain 1F1B
  (Narayanan et al. used interleaving; the 2024 README does not say);
- GPT layout as Megatron's: ffn = 4h, tied embeddings, learned positions,
  dropout 0.1 (BLOOM: 0.0);
- overlap: off for the 2020/2021 Megatron-LM and BLOOM runs (that code
  reduced gradients after the backward pass), on for ZeRO-3 (DeepSpeed's
  overlap_comm) and for the 2024 README runs (their flags);
- 2024 README runs: distributed optimizer (ZeRO-1, implied by
  --overlap-param-gather), sequence parallelism when tp > 1 (implied by
  --tp-comm-overlap), no activation recompute (flash attention);
- 2020 README runs: full recompute (their example scripts'
  --checkpoint-activations; their TF/s match Eq. 3), A100-40GB;
- the two strong-scaling rows state no layout: tp 8, pp 6 as the 177B
  weak-scaling row, dp from the GPU count;
- V100 (DGX-2) has no ptc preset: 125 TFLOP/s fp16, 32 GB, NVSwitch 150 GB/s
  per direction, 16 GPUs per node, 8 x 100 Gb/s InfiniBand per node,
  achievable_fraction 0.55 as the A100's (same-generation tensor-core GEMMs);
- BLOOM's Jean Zay nodes: 4 x 100 Gb/s Omni-Path per 8 GPUs (from its notes);
- gradients: fp16 runs keep and all-reduce them in fp16 (Megatron-LM without
  --accumulate-allreduce-grads-in-fp32, its default then), bf16 runs in fp32
  (Megatron-LM forces fp32 main gradients with bf16; DeepSpeed's bf16
  optimizer accumulates in fp32): `train.grad_dtype` (ZeRO-3 rows: fp32, the
  only choice ptc's ZeRO-3 has).
Usage: python bench/validate_cost_model.py [--csv PATH]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ptc.compiler.estimate import estimate  # noqa: E402
from ptc.compiler.shapes import plan_from_shape  # noqa: E402
from ptc.plan import HardwareSpec, LinkSpec  # noqa: E402

GB_S = 1e9
V100 = HardwareSpec(
    gpu="V100-DGX2", nodes=1, gpus_per_node=16, hbm_bytes=32 * 2**30,
    peak_flops={"fp32": 15.7e12, "fp16": 125e12}, mem_bandwidth=900 * GB_S,
    intra=LinkSpec(bandwidth=150 * GB_S, latency=3e-6),
    inter=LinkSpec(bandwidth=8 * 12.5 * GB_S / 16, latency=6e-6),
    nvlink_sharp=False, achievable_fraction=0.55)


class NotExpressible(Exception):
    """A row ptc cannot express as a plan; the message says why."""


def _csv_path(given: str | None) -> Path:
    if given:
        return Path(given)
    base = os.environ.get("PTC_VALIDATION_DIR")
    root = Path(base) if base else Path(__file__).resolve().parents[2] / "shared" / "validation"
    return root / "published_runs.csv"


def _int(row: dict, key: str, default: int | None = None) -> int | None:
    return int(float(row[key])) if row[key].strip() else default


def _hardware(row: dict) -> tuple[str | HardwareSpec, str, list[str]]:
    """(gpu preset or spec, dtype, notes) of a row."""
    gpu = row["gpu"]
    if gpu.startswith("V100"):
        return V100, "fp16", ["V100 figures of the script docstring"]
    if gpu.startswith("H100"):
        return "H100-SXM", "bf16", []
    if "2020" in gpu:
        return "A100-40GB", "fp16", ["A100-40GB (2020 DGX-A100)"]
    if "Jean Zay" in gpu:
        hw = HardwareSpec.preset("A100-80GB")
        inter = LinkSpec(bandwidth=4 * 12.5 * GB_S / 8, latency=hw.inter.latency)
        return HardwareSpec.preset("A100-80GB", inter=inter), "bf16", ["4x100Gb/s OPA per node"]
    return "A100-80GB", "fp16", []


def _vstages(layers: int, pp: int, microbatches: int) -> int:
    per_stage = layers // pp
    v = next((c for c in range(2, per_stage + 1) if per_stage % c == 0), 1)
    return v if v <= 8 and microbatches % pp == 0 else 1


def build(row: dict):
    """The Plan of one row and the assumptions made for it."""
    src = row["source"]
    gpu, dtype, notes = _hardware(row)
    L, h, a, V, s = (int(row[k]) for k in ("layers", "hidden", "heads", "vocab", "seq"))
    n, B = int(row["num_gpus"]), int(row["global_batch"])
    readme24 = "README-H100-2024" in src
    bloom, zero3 = "BigScience" in src, row["zero"].strip() == "3"
    tp, pp = _int(row, "tp"), _int(row, "pp")
    if tp is None:
        tp, pp = 8, 6
        notes.append("tp8 pp6 (177B weak-scaling layout)")
    dp = n // (tp * pp)
    b = _int(row, "micro_batch")
    if b is None:
        b = 1
        notes.append("micro_batch 1")
    if L % pp:
        raise NotExpressible(f"layers({L}) not divisible by pp({pp}): ptc splits layers evenly")
    v = _vstages(L, pp, B // (dp * b)) if pp > 1 else 1
    if pp > 1 and not row["vpp"].strip():
        notes.append(f"v={v}" if v > 1 else "1f1b")
    zero = _int(row, "zero", 1 if readme24 else 0)
    sp = bool(_int(row, "sp", 1 if readme24 and tp > 1 else 0)) and tp > 1
    ckpt = row["recompute"].strip() or ("none" if readme24 else "full")
    if not row["recompute"].strip():
        notes.append(f"checkpoint {ckpt}")
    if readme24 and not row["zero"].strip():
        notes.append("zero1 + sp" if sp else "zero1")
    overlap = readme24 or zero3
    plan = plan_from_shape(
        family="gpt", layers=L, hidden=h, heads=a, vocab=V, seq_len=s, global_batch=B,
        gpu=gpu, num_gpus=n, ffn=_int(row, "ffn", 4 * h), tied_embeddings=True,
        dropout=0.0 if bloom else 0.1, tp=tp, pp=pp, dp=dp, micro_batch=b, dtype=dtype,
        gpus_per_node=16 if gpu is V100 else 8, zero=zero, sequence_parallel=sp,
        schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v, checkpoint=ckpt,
        overlap=overlap)
    if dtype == "fp16" and zero < 3:  # ptc's ZeRO-3 reduce-scatters in fp32 only
        plan = dataclasses.replace(plan, train=dataclasses.replace(plan.train, grad_dtype="fp16"))
    return plan, notes


def score(row: dict, step: float) -> tuple[str, float, float]:
    """(convention, predicted, measured) of a row given a predicted step time."""
    L, h, V, s = (int(row[k]) for k in ("layers", "hidden", "vocab", "seq"))
    n, B = int(row["num_gpus"]), int(row["global_batch"])
    if row["iter_time_s"].strip():
        return "iter_s", step, float(row["iter_time_s"])
    if "Narayanan" in row["source"]:
        flops = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
        return "eq3_TF", flops / step / n / 1e12, float(row["tflops_per_gpu"])
    flops = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    measured = float(row["tflops_per_gpu"]) if row["tflops_per_gpu"].strip() \
        else float(row["mfu"]) * 989
    return "model_TF", flops / step / n / 1e12, measured


def main(argv: list[str] | None = None) -> int:
    """Print per-row errors, then the median and max |error|."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", help="path of published_runs.csv")
    args = parser.parse_args(argv)
    rows = list(csv.DictReader(_csv_path(args.csv).open()))
    errors = []
    print(f"{'model':<14}{'gpus':>6} {'tp':>3}{'pp':>4}{'dp':>6} {'conv':<9}"
          f"{'pred':>9}{'meas':>9}{'err':>8}  assumed")
    for row in rows:
        try:
            plan, notes = build(row)
        except NotExpressible as exc:
            print(f"{row['model'][:14]:<14}{row['num_gpus']:>6}  skipped: {exc}")
            continue
        est = estimate(plan)
        conv, pred, meas = score(row, est.step_time_s)
        err = (pred - meas) / meas
        errors.append(abs(err))
        p = plan.parallel
        print(f"{row['model'][:14]:<14}{row['num_gpus']:>6} {p.tp:>3}{p.pp:>4}{p.dp:>6} "
              f"{conv:<9}{pred:>9.2f}{meas:>9.2f}{err:>+8.1%}  {', '.join(notes)}")
    print(f"\n{len(errors)} rows scored; median |error| {statistics.median(errors):.1%}, "
          f"max |error| {max(errors):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
