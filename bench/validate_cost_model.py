"""Score ptc's cost model against published training runs.

Reads `published_runs.csv` (from $PTC_VALIDATION_DIR, else ../shared/validation
beside the repository), builds each run as a Plan from its shape numbers,
predicts the step time with `ptc.compiler.search.estimate.estimate`, and compares
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
  dropout 0.1 (BLOOM: 0.0); ptc's GPT writes its attention out (scores,
  mask, softmax, dropout), as Megatron-LM's 2020-2021 code ran it;
- 2024 README runs ran flash attention: their layers are priced as a model
  whose attention is `scaled_dot_product_attention` (ptc's llama family
  with GPT's LayerNorm, GELU MLP of 4h, biases and tied embeddings, all
  heads for keys and values; rotary positions instead of learned ones, a
  table of s·h weights fewer), so no s × s scores pass through memory;
- fused kernels (`runtime.compile`): Megatron-LM (bias-GeLU, bias-dropout-add,
  fused LayerNorm and scale-mask-softmax since 2021, Transformer Engine's in
  2024) and Megatron-DeepSpeed run the memory-bound ops between GEMMs fused;
- overlap: off for the 2020/2021 Megatron-LM and BLOOM runs (that code
  reduced gradients after the backward pass), on for ZeRO-3 (DeepSpeed's
  overlap_comm) and for the 2024 README runs (their flags);
- 2024 README runs: distributed optimizer (ZeRO-1, implied by
  --overlap-param-gather), sequence parallelism when tp > 1 with its
  collectives as collective matmuls (`tp_comm = async`: --tp-comm-overlap),
  no activation recompute (flash attention);
- 2020 README runs: full recompute (their example scripts'
  --checkpoint-activations; their TF/s match Eq. 3), A100-40GB;
- the two strong-scaling rows state no layout: tp 8, pp 6 as the 177B
  weak-scaling row, dp from the GPU count;
- GPUs by preset: V100 (DGX-2) "V100-SXM2-32GB" (16 GPUs per node on
  NVSwitch, 8 x 100 Gb/s InfiniBand per node), the 2020 DGX-A100 "A100-40GB",
  other A100 rows "A100-80GB", H100 "H100-SXM", H200 "H200", B200 "B200";
- the pipeline cut: where pp divides the layers, the even split the runs used
  (Megatron-LM's and DeepSpeed's default), pinned with `first_stage_layers` /
  `last_stage_layers` (left open, ptc would price the cut it compiles, which its
  cost model balances);
- layers not divisible by pp: Megatron-DeepSpeed's `type:transformer|embedding`
  partition (BLOOM's) counts each embedding as a layer, so the first and last
  stage hold one transformer layer fewer than the others
  (`parallel.first_stage_layers` / `last_stage_layers`); a row whose split
  follows from nothing it says is not expressible; DeepSpeed's pipeline
  engine does not interleave (1F1B);
- BLOOM's Jean Zay nodes: 4 x 100 Gb/s Omni-Path per 8 GPUs (from its notes);
- gradients: fp16 runs keep and all-reduce them in fp16 (Megatron-LM without
  --accumulate-allreduce-grads-in-fp32, its default then), bf16 runs in fp32
  (Megatron-LM forces fp32 main gradients with bf16; DeepSpeed's bf16
  optimizer accumulates in fp32): `train.grad_dtype` (ZeRO-3 rows: fp32, the
  only choice ptc's ZeRO-3 has).
Prints each row, then per source the median |error|, the worst rows with
their estimate's breakdown (seconds per part of the step, as shares of it),
and the rows not expressible with the reason for each.

With --solve-shares it also prints, per chip, the GEMM share of peak that
makes each run exact and their median: the presets' `achievable_fraction`
(ptc/presets.py) is that median, one parameter per chip.

The presets' shares are solved from these rows, so the figures above are in
sample: each chip's share is fitted to the rows it is scored on. With
--held-out it also scores every source out of sample (leave one source out):
for each source S, each chip's share is the median of the shares solved by
the rows of the other sources (each row's share is solved once and
recombined), and S's rows are priced with it, all else as priced. A chip with
no row outside S takes the share of the chip the presets price it by (H200,
B200, B300, GB200 and GB300 take H100's), and failing that the median over every
row outside S, all chips together (H100 when S is the 2024 README, V100 when
it is the 2020 README). It prints per source the median and max |error| in
sample and held out, then for each the median, p90, max and the rows within
10 % and 25 %.

Usage: python bench/validate_cost_model.py [--csv PATH] [--worst N] [--solve-shares]
       [--held-out]
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

from ptc.compiler.search.estimate import estimate  # noqa: E402
from ptc.compiler.shapes import even_cut, plan_from_shape  # noqa: E402
from ptc.plan import HardwareSpec, LinkSpec  # noqa: E402
from ptc.presets import PRESETS  # noqa: E402

GB_S = 1e9


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
        return "V100-SXM2-32GB", "fp16", []
    if gpu.startswith("H100"):
        return "H100-SXM", "bf16", []
    if gpu.startswith(("H200", "B200")):
        return gpu[:4], "bf16", []
    if "2020" in gpu:
        return "A100-40GB", "fp16", ["A100-40GB (2020 DGX-A100)"]
    if "Jean Zay" in gpu:
        hw = HardwareSpec.preset("A100-80GB")
        inter = LinkSpec(bandwidth=4 * 12.5 * GB_S / 8, latency=hw.inter.latency)
        return HardwareSpec.preset("A100-80GB", inter=inter), "bf16", ["4x100Gb/s OPA per node"]
    if gpu.startswith("A100"):
        return "A100-80GB", "fp16", []
    raise NotExpressible(f"no preset for gpu {gpu!r} (presets: {', '.join(PRESETS)})")


def _uneven(L: int, pp: int, deepspeed: bool, notes: list[str]) -> dict:
    """first/last_stage_layers of the row's pipeline cut (module docstring)."""
    if not L % pp:
        return even_cut(L, pp)
    if not deepspeed or (L + 2) % pp:
        raise NotExpressible(f"layers({L}) not divisible by pp({pp}), and the source gives "
                             f"no first/last stage layer counts")
    ends = (L + 2) // pp - 1
    notes.append(f"first/last stage {ends} layers (embeddings counted as layers)")
    return dict(first_stage_layers=ends, last_stage_layers=ends)


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
    split = _uneven(L, pp, bloom, notes)
    v = _vstages(L, pp, B // (dp * b)) if pp > 1 and not bloom else 1
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
        zero=zero, sequence_parallel=sp, tp_comm="async" if sp and readme24 else "sync",
        schedule="interleaved" if v > 1 else "1f1b",
        virtual_stages=v, checkpoint=ckpt, overlap=overlap, **split)
    if readme24:  # flash attention: a layer whose attention is SDPA (module docstring)
        plan = dataclasses.replace(plan, model=dataclasses.replace(
            plan.model, family="llama", norm="layernorm", activation="gelu", bias=True,
            tied_embeddings=True, kv_heads=a, dropout=0.0))
        notes.append("flash attention")
    # Megatron-LM and DeepSpeed run fused kernels (runtime.compile: ptc's runtime fuses the
    # same chains of memory-bound ops).
    plan = dataclasses.replace(plan, runtime=dataclasses.replace(plan.runtime, compile=True))
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


def solved_share(row: dict, plan) -> float:
    """The GEMM share of peak (`achievable_fraction`) at which the row's prediction equals its
    measurement, everything else as priced (bisection: the step shortens as the share grows)."""
    lo, hi = 0.01, 1.0
    for _ in range(20):
        mid = (lo + hi) / 2
        hw = dataclasses.replace(plan.hardware, achievable_fraction=mid)
        conv, pred, meas = score(row, estimate(dataclasses.replace(plan, hardware=hw)).step_time_s)
        fast = pred < meas if conv == "iter_s" else pred > meas
        lo, hi = (lo, mid) if fast else (mid, hi)
    return (lo + hi) / 2


FAMILY = {"H200": "H100", "B200": "H100", "B300": "H100", "GB200": "H100", "GB300": "H100"}
"""Chips the presets price with another chip's share (ptc/presets.py): Hopper's H100 share."""


def _chip(plan) -> str:
    """The chip a row's share belongs to: both A100 memory sizes are one chip."""
    return plan.hardware.gpu.split("-")[0]


def print_shares(scored: list, shares: list[float]) -> None:
    """Per chip, the share each run solves for and their median: the presets' shares."""
    print("\nGEMM share of peak that makes each run exact, per chip (the presets take the median)")
    by_chip: dict[str, list[float]] = {}
    for (_, plan, _, _), share in zip(scored, shares):
        by_chip.setdefault(_chip(plan), []).append(share)
    for chip, solved in by_chip.items():
        listed = " ".join(f"{x:.2f}" for x in sorted(solved))
        print(f"  {chip:<6}{len(solved):>4} runs  median {statistics.median(solved):.3f}: {listed}")


def held_out_share(chip: str, others: list[tuple[str, float]]) -> tuple[float, str]:
    """The share a chip is priced with when its source is held out, and whose it is: the
    median of `others` ((chip, solved share) of the rows outside the source) on the chip, else
    on the chip the presets price it by, else on every chip (module docstring)."""
    for key in (chip, FAMILY.get(chip)):
        solved = [x for c, x in others if c == key]
        if solved:
            return statistics.median(solved), key
    return statistics.median(x for _, x in others), "all"


def error_summary(errors: list[float]) -> str:
    """Median, p90 and max of |error| and the rows within 10 % and 25 %: the one summary line
    every validation script prints, so in-sample and out-of-sample figures read alike."""
    errs = sorted(abs(e) for e in errors)
    p90 = statistics.quantiles(errs, n=10, method="inclusive")[-1]
    within = [sum(e <= bound for e in errs) for bound in (0.10, 0.25)]
    return (f"median |error| {statistics.median(errs):.1%}, p90 {p90:.1%}, max {errs[-1]:.1%}; "
            f"{within[0]} of {len(errs)} within 10 %, {within[1]} within 25 %")


def held_out_errors(scored: list, shares: list[float], source: str) -> tuple[list, dict]:
    """The errors of `source`'s rows priced with the shares the other sources' rows solve
    for, and the share used per chip (with whose rows set it)."""
    others = [(_chip(plan), x) for (row, plan, _, _), x in zip(scored, shares)
              if _short(row["source"]) != source]
    errors, used = [], {}
    for row, plan, _, _ in scored:
        if _short(row["source"]) != source:
            continue
        used.setdefault(_chip(plan), held_out_share(_chip(plan), others))
        hw = dataclasses.replace(plan.hardware, achievable_fraction=used[_chip(plan)][0])
        _, pred, meas = score(row, estimate(dataclasses.replace(plan, hardware=hw)).step_time_s)
        errors.append((pred - meas) / meas)
    return errors, used


def print_held_out(scored: list, shares: list[float]) -> None:
    """Per source, |error| in sample (the presets' shares, fitted to every row) and held out
    (shares solved from the other sources' rows only); then both summaries."""
    print("\nleave one source out: each source priced with each chip's median share over the "
          "other sources' rows")
    print(f"  {'source':<31}{'rows':>4}{'in sample med/max':>18}{'held out med/max':>19}   "
          "share used (whose rows)")
    inside, held = [], []
    for source in dict.fromkeys(_short(r["source"]) for r, *_ in scored):
        errs_in = [abs(e) for r, _, _, e in scored if _short(r["source"]) == source]
        errs_out, used = held_out_errors(scored, shares, source)
        errs_out = [abs(e) for e in errs_out]
        inside += errs_in
        held += errs_out
        shown = ", ".join(f"{chip} {x:.3f} ({key})" for chip, (x, key) in used.items())
        print(f"  {source:<31}{len(errs_in):>4} {statistics.median(errs_in):>8.1%}"
              f"{max(errs_in):>8.1%}   {statistics.median(errs_out):>8.1%}"
              f"{max(errs_out):>8.1%}   {shown}")
    print(f"in sample (presets' shares):      {error_summary(inside)}")
    print(f"held out (leave one source out):  {error_summary(held)}")


def _short(source: str) -> str:
    return source.split(" (")[0]


def main(argv: list[str] | None = None) -> int:
    """Print per-row errors, per-source medians, the worst rows' breakdowns, the rows skipped."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", help="path of published_runs.csv")
    parser.add_argument("--worst", type=int, default=5, help="rows to break down (default 5)")
    parser.add_argument("--solve-shares", action="store_true",
                        help="also print, per chip, the GEMM share of peak each run solves for "
                             "(how the presets' achievable_fraction is set; about a minute)")
    parser.add_argument("--held-out", action="store_true",
                        help="also score each source with shares solved from the other "
                             "sources' rows only (leave one source out; about a minute)")
    args = parser.parse_args(argv)
    rows = list(csv.DictReader(_csv_path(args.csv).open()))
    scored, skipped = [], []
    print(f"{'model':<14}{'gpus':>6} {'tp':>3}{'pp':>4}{'dp':>6} {'conv':<9}"
          f"{'pred':>9}{'meas':>9}{'err':>8}  assumed")
    for row in rows:
        try:
            plan, notes = build(row)
        except NotExpressible as exc:
            skipped.append((row, str(exc)))
            print(f"{row['model'][:14]:<14}{row['num_gpus']:>6}  skipped: {exc}")
            continue
        est = estimate(plan)
        conv, pred, meas = score(row, est.step_time_s)
        err = (pred - meas) / meas
        scored.append((row, plan, est, err))
        p = plan.parallel
        print(f"{row['model'][:14]:<14}{row['num_gpus']:>6} {p.tp:>3}{p.pp:>4}{p.dp:>6} "
              f"{conv:<9}{pred:>9.2f}{meas:>9.2f}{err:>+8.1%}  {', '.join(notes)}")
    print("\nper source: rows, median |error|, max |error|")
    for source in dict.fromkeys(_short(r["source"]) for r, *_ in scored):
        errs = [abs(e) for r, _, _, e in scored if _short(r["source"]) == source]
        print(f"  {source:<28}{len(errs):>4} {statistics.median(errs):>8.1%} {max(errs):>8.1%}")
    print(f"\nworst {args.worst} rows: step time and its parts as shares of it")
    for row, plan, est, err in sorted(scored, key=lambda x: -abs(x[3]))[:args.worst]:
        parts = ", ".join(f"{k} {v / est.step_time_s:.0%}" for k, v in est.breakdown.items() if v)
        p = plan.parallel
        print(f"  {row['model'][:14]:<14} {row['num_gpus']:>5} GPUs tp{p.tp} pp{p.pp} dp{p.dp} "
              f"zero{p.zero} {p.checkpoint}: {err:+.1%}; step {est.step_time_s:.3g} s = {parts}")
    print(f"\n{len(scored)} of {len(rows)} rows expressible; {len(skipped)} not:")
    for row, why in skipped:
        print(f"  {row['model']} on {row['num_gpus']} ({_short(row['source'])}): {why}")
    shares = [solved_share(row, plan) for row, plan, _, _ in scored] \
        if args.solve_shares or args.held_out else []
    if args.solve_shares:
        print_shares(scored, shares)
    if args.held_out:
        print_held_out(scored, shares)
    errors = [abs(e) for *_, e in scored]
    print(f"\n{len(errors)} rows scored; median |error| {statistics.median(errors):.1%}, "
          f"max |error| {max(errors):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
