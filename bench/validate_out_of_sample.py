"""Score ptc's cost model on published runs it was not set by: Megatron-Bridge's dense Llama.

`bench/validate_cost_model.py` scores the runs of ../shared/validation, the
runs the presets' `achievable_fraction` is solved from. This script scores the
same mechanisms, unchanged, on runs outside that file: the dense Llama 3 rows
of NVIDIA Megatron-Bridge's performance summary (docs/performance-summary.md
and docs/performance-summary-archive.md of NVIDIA-NeMo/Megatron-Bridge, the
archive as of commit 067f987df03b: its "Pre-Training Performance" tables of
NeMo containers 26.06, 26.04.01, 26.04, 26.02.01, 26.02, 25.11 and 25.09),
tokens per second per GPU on DGX-H100, DGX-B200, DGX-GB200 and DGX-GB300, in
FP8 (per-tensor current scaling, "FP8-CS"; "FP8" from 26.04 on; priced as
ptc's fp8 tensorwise recipe) or MXFP8 (32-element block scales: the same FP8
GEMM peak; priced as `train.fp8_recipe = mxfp8`, current scaling, with its
casts). The 25.09 page gives no precision column; its rows are the FP8 ones
(its footnote names their quantisation granularities). The 26.06 table gives no FSDP column:
its rows are read as FSDP 0, the value every other container gives those
405B layouts.

Each row is built as its recipe runs it, with the same defaults for every
row:
- Llama 3 shapes (8B: 32 layers, h 4096, 32 heads, ffn 14336; 70B: 80, 8192,
  64, 28672; 405B: 126, 16384, 128, 53248), 8 key/value heads, vocab 128256,
  untied embeddings, flash attention (ptc's llama family runs SDPA), no
  dropout, no activation recompute;
- FSDP > 0: ZeRO-3 over the data-parallel ranks; else the distributed
  optimizer (ZeRO-1); sequence parallelism when tp > 1, its collectives as
  collective matmuls (`tp_comm = async`: the recipes' CommOverlapConfig
  with tp_comm_overlap, Transformer Engine's userbuffers); communication
  overlapped; fused memory-bound kernels (`runtime.compile`);
- the pipeline cut: Megatron's even split where pp divides the layers (pinned:
  left open, ptc would price the cut its cost model balances);
- 405B's 126 layers: Megatron's split that counts the embedding and the loss
  as a layer each, so the first and the last stage hold 128/pp - 1 layers;
- interleaving when VP > 1 (VP = 1 and "n/a": 1F1B);
- runs of more than 72 GPUs on GB200/GB300 use 64 GPUs of each NVL72 rack.
Rows in NVFP4 (ptc has no 4-bit compute) are not expressible and are not listed; the
mixture-of-experts rows are scored by `bench/validate_moe.py`.

It prints each row, then the median, p90 and max |error|, the rows within 10 %
and 25 %, and the ordering of pairs: for every two rows of the same model on
the same system measured more than 3 % apart (closer, repeated measurements of
one layout differ as much), whether ptc predicts them in the measured order.
Pairs ptc predicts within 0.5 % of each other are counted apart, as predicted
equal: equal plans (one layout in two containers or two FP8 recipes), or
plans that differ only in what ptc prices alike (the scale of a weak-scaling
series).

Usage: python bench/validate_out_of_sample.py
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ptc.compiler.search.estimate import estimate  # noqa: E402
from ptc.compiler.shapes import even_cut, plan_from_shape  # noqa: E402
from ptc.errors import PlanError  # noqa: E402
from validate_cost_model import error_summary  # noqa: E402

LLAMA3 = {
    "8B": dict(layers=32, hidden=4096, heads=32, ffn=14336),
    "70B": dict(layers=80, hidden=8192, heads=64, ffn=28672),
    "405B": dict(layers=126, hidden=16384, heads=128, ffn=53248),
}
"""Llama 3 / 3.1 shapes (Meta's model cards; all with 8 key/value heads, vocab 128256)."""

SEQ = 8192
"""Every dense Llama row of the summary trains at sequence length 8192."""

RUNS = [  # container, model, system, GPUs, GBS, MBS, FSDP, TP, PP, CP, VP, tokens/s/GPU, precision
    ("26.06", "405B", "GB300", 256, 1536, 1, 0, 4, 8, 1, 4, 1048, "FP8"),
    ("26.06", "405B", "GB300", 256, 1536, 1, 0, 2, 8, 2, 4, 952, "MXFP8"),
    ("26.06", "405B", "GB200", 256, 1536, 1, 0, 4, 16, 1, 4, 843, "FP8"),
    ("26.06", "405B", "GB200", 256, 1536, 1, 0, 4, 16, 1, 8, 783, "MXFP8"),
    ("26.06", "405B", "H100-SXM", 1024, 1536, 1, 0, 8, 8, 2, 8, 326, "FP8"),
    ("26.04.01", "70B", "GB300", 64, 256, 2, 1, 1, 1, 1, 1, 5248, "FP8"),
    ("26.04.01", "70B", "GB300", 64, 256, 1, 0, 1, 4, 1, 5, 4864, "MXFP8"),
    ("26.04.01", "70B", "GB200", 64, 256, 2, 1, 1, 1, 1, 1, 4224, "FP8"),
    ("26.04.01", "70B", "GB200", 64, 256, 1, 0, 2, 4, 1, 5, 3712, "MXFP8"),
    ("26.04.01", "70B", "H100-SXM", 64, 256, 1, 0, 4, 8, 1, 5, 1664, "FP8"),
    ("26.04.01", "405B", "GB300", 256, 1536, 1, 0, 4, 8, 1, 4, 1024, "FP8"),
    ("26.04.01", "405B", "GB300", 256, 1536, 1, 0, 2, 8, 2, 4, 960, "MXFP8"),
    ("26.04.01", "405B", "GB200", 256, 1536, 1, 0, 4, 16, 1, 4, 864, "FP8"),
    ("26.04.01", "405B", "GB200", 256, 1536, 1, 0, 4, 16, 1, 8, 800, "MXFP8"),
    ("26.04.01", "405B", "H100-SXM", 1024, 1536, 1, 0, 8, 8, 2, 8, 328, "FP8"),
    ("26.04", "70B", "GB300", 64, 256, 1, 0, 1, 4, 1, 5, 4742, "MXFP8"),
    ("26.04", "70B", "GB200", 64, 256, 1, 0, 2, 4, 1, 5, 3828, "MXFP8"),
    ("26.04", "70B", "GB300", 64, 256, 2, 1, 1, 1, 1, 1, 5243, "FP8"),
    ("26.04", "70B", "GB200", 64, 256, 2, 1, 1, 1, 1, 1, 4143, "FP8"),
    ("26.04", "70B", "H100-SXM", 64, 256, 1, 0, 4, 8, 1, 5, 1633, "FP8"),
    ("26.04", "405B", "GB300", 256, 1536, 1, 0, 2, 8, 2, 4, 968, "MXFP8"),
    ("26.04", "405B", "GB200", 256, 1536, 1, 0, 4, 16, 1, 8, 793, "MXFP8"),
    ("26.04", "405B", "GB300", 256, 1536, 1, 0, 4, 8, 1, 4, 1036, "FP8"),
    ("26.04", "405B", "GB200", 256, 1536, 1, 0, 4, 16, 1, 4, 842, "FP8"),
    ("26.02.01", "70B", "GB300", 64, 256, 2, 0, 1, 4, 1, 1, 4798, "MXFP8"),
    ("26.02.01", "70B", "GB200", 64, 256, 1, 0, 2, 4, 1, 5, 3837, "MXFP8"),
    ("26.02.01", "70B", "GB300", 64, 256, 2, 1, 1, 1, 1, 1, 5243, "FP8"),
    ("26.02.01", "70B", "GB200", 64, 256, 2, 1, 1, 1, 1, 1, 4357, "FP8"),
    ("26.02.01", "70B", "H100-SXM", 64, 256, 1, 0, 4, 8, 1, 5, 1639, "FP8"),
    ("26.02.01", "405B", "GB300", 256, 1536, 1, 0, 2, 8, 2, 4, 949, "MXFP8"),
    ("26.02.01", "405B", "GB200", 256, 1536, 1, 0, 4, 16, 1, 8, 775, "MXFP8"),
    ("26.02.01", "405B", "GB300", 256, 1536, 1, 0, 2, 8, 2, 4, 1024, "FP8"),
    ("26.02.01", "405B", "GB200", 256, 1536, 1, 0, 4, 16, 1, 4, 818, "FP8"),
    ("26.02", "70B", "GB300", 64, 256, 2, 1, 1, 1, 1, 1, 5003, "FP8"),
    ("26.02", "70B", "GB200", 64, 256, 2, 1, 1, 1, 1, 1, 4040, "FP8"),
    ("26.02", "70B", "H100-SXM", 64, 256, 1, 0, 4, 8, 1, 5, 1621, "FP8"),
    ("26.02", "70B", "GB300", 64, 256, 1, 0, 1, 4, 1, 5, 4596, "MXFP8"),
    ("26.02", "70B", "GB200", 64, 256, 1, 0, 2, 4, 1, 5, 3613, "MXFP8"),
    ("26.02", "405B", "GB300", 256, 1536, 1, 0, 2, 8, 2, 4, 931, "MXFP8"),
    ("26.02", "405B", "GB200", 256, 1536, 1, 0, 4, 16, 1, 8, 786, "MXFP8"),
    ("26.02", "405B", "GB300", 256, 1536, 1, 0, 4, 8, 1, 4, 988, "FP8"),
    ("26.02", "405B", "GB200", 256, 1536, 1, 0, 4, 16, 1, 4, 793, "FP8"),
    ("26.02", "405B", "H100-SXM", 1024, 1536, 1, 0, 8, 8, 2, 8, 311, "FP8"),
    ("25.11", "8B", "GB300", 8, 128, 2, 0, 1, 1, 1, 1, 37556, "FP8"),
    ("25.11", "70B", "GB300", 64, 256, 2, 1, 1, 1, 1, 1, 4520, "FP8"),
    ("25.11", "405B", "GB300", 256, 1536, 1, 0, 2, 8, 2, 4, 999, "FP8"),
    ("25.11", "8B", "GB200", 8, 128, 2, 0, 1, 1, 1, 1, 31508, "FP8"),
    ("25.11", "70B", "GB200", 64, 256, 2, 1, 1, 1, 1, 1, 4312, "FP8"),
    ("25.11", "405B", "GB200", 256, 1536, 1, 0, 4, 16, 1, 4, 813, "FP8"),
    ("25.11", "8B", "B200", 8, 128, 2, 0, 1, 1, 1, 1, 30624, "FP8"),
    ("25.11", "405B", "B200", 128, 64, 1, 0, 4, 8, 2, 8, 661, "FP8"),
    ("25.11", "8B", "H100-SXM", 8, 128, 1, 1, 1, 1, 1, 1, 14451, "FP8"),
    ("25.11", "70B", "H100-SXM", 64, 128, 1, 0, 4, 8, 1, 5, 1602, "FP8"),
    ("25.11", "405B", "H100-SXM", 1024, 512, 1, 0, 8, 8, 2, 8, 292, "FP8"),
    ("25.09", "8B", "GB200", 8, 128, 2, 0, 1, 1, 1, 1, 31357, "FP8"),
    ("25.09", "70B", "GB200", 64, 128, 2, 1, 1, 1, 1, 1, 3986, "FP8"),
    ("25.09", "70B", "GB200", 64, 128, 2, 0, 2, 4, 1, 5, 3546, "FP8"),
    ("25.09", "405B", "GB200", 128, 64, 1, 1, 2, 1, 1, 1, 729, "FP8"),
    ("25.09", "405B", "GB200", 128, 64, 1, 0, 4, 8, 2, 8, 578, "FP8"),
    ("25.09", "8B", "B200", 8, 128, 2, 0, 1, 1, 1, 1, 29994, "FP8"),
    ("25.09", "405B", "B200", 128, 64, 1, 0, 4, 8, 2, 8, 664, "FP8"),
    ("25.09", "8B", "H100-SXM", 8, 128, 1, 1, 1, 1, 1, 1, 14079, "FP8"),
    ("25.09", "70B", "H100-SXM", 64, 128, 1, 0, 4, 8, 1, 5, 1619, "FP8"),
    ("25.09", "405B", "H100-SXM", 1024, 512, 1, 0, 8, 8, 2, 8, 302, "FP8"),
]
"""Megatron-Bridge's dense Llama rows in FP8 / MXFP8 (module docstring)."""
RECIPES = {"FP8": "tensorwise", "MXFP8": "mxfp8"}
"""A row's precision -> the plan's train.fp8_recipe (module docstring)."""


NOISE = 0.03
"""Two runs measured within this share of the larger are not ordered: repeated measurements
of one layout in these tables (one recipe in two containers, a weak-scaling series) differ by
up to about 3 % (module docstring)."""
EQUAL = 0.005
"""Two predictions within this share of the larger are predicted equal (module docstring)."""


def build(model: str, gpu: str, gpus: int, gbs: int, mbs: int, fsdp: int, tp: int, pp: int,
          cp: int, vp: int, dtype: str = "fp8", layers: int | None = None,
          precision: str = "FP8"):
    """The Plan of one row, built by the module docstring's defaults (`layers`: a run of the
    model's layers cut to that many, as benchmark proxies of a large model are; `precision`:
    the row's, "FP8" or "MXFP8", as RECIPES maps it)."""
    shape = {**LLAMA3[model], "layers": layers or LLAMA3[model]["layers"]}
    split = even_cut(shape["layers"], pp)
    if shape["layers"] % pp:  # the embedding and the loss count as a layer each
        ends = (shape["layers"] + 2) // pp - 1
        split = dict(first_stage_layers=ends, last_stage_layers=ends)
    rack = 64 if gpu.startswith("GB") and gpus > 72 else None
    plan = plan_from_shape(
        family="llama", vocab=128256, kv_heads=8, seq_len=SEQ, global_batch=gbs, gpu=gpu,
        num_gpus=gpus, tp=tp, pp=pp, dp=gpus // (tp * pp * cp), cp=cp, micro_batch=mbs,
        dtype=dtype, zero=3 if fsdp else 1, sequence_parallel=tp > 1,
        tp_comm="async" if tp > 1 else "sync",
        schedule="interleaved" if vp > 1 else "1f1b", virtual_stages=vp, checkpoint="none",
        overlap=True, tied_embeddings=False, gpus_per_node=rack, **shape, **split)
    plan = dataclasses.replace(plan, runtime=dataclasses.replace(plan.runtime, compile=True))
    if RECIPES[precision] == "tensorwise":
        return plan
    return dataclasses.replace(plan, train=dataclasses.replace(
        plan.train, fp8_recipe=RECIPES[precision], fp8_scaling="current"))


def pair_order(rows: list[tuple[tuple, object, float, float]]) -> str:
    """How ptc orders the pairs of rows of one key (model and system); rows: (key, plan,
    predicted, measured). Pairs measured within NOISE of each other are left out (closer,
    run-to-run variation decides their order). A pair ptc predicts within EQUAL of each
    other (equal plans among them) is tied: what differs between the two runs (a software
    release, the scale of a weak-scaling series) is not in the plan or not priced. The
    other pairs are orderable."""
    ordered = pairs = tied = 0
    for (k1, plan1, p1, m1), (k2, plan2, p2, m2) in itertools.combinations(rows, 2):
        if k1 != k2 or abs(m1 - m2) <= NOISE * max(m1, m2):
            continue
        if plan1 == plan2 or abs(p1 - p2) <= EQUAL * max(p1, p2):
            tied += 1
            continue
        pairs += 1
        ordered += (p1 > p2) == (m1 > m2)
    return (f"{ordered} of {pairs} orderable pairs ordered as measured; {tied} pairs "
            f"predicted equal (equal plans, or within {EQUAL:.1%})")


def main() -> int:
    """Print each row's predicted and measured tokens/s per GPU, then the error summary and
    how well ptc orders the rows of one model on one system."""
    print(f"{'ngc':<9}{'model':<6}{'gpu':<10}{'gpus':>5}  layout{'':<17}{'pred':>7}{'meas':>7}"
          f"{'err':>8}  step parts")
    errors, ranked = [], []
    for container, model, gpu, gpus, gbs, mbs, fsdp, tp, pp, cp, vp, measured, precision in RUNS:
        layout = f"{'fsdp ' if fsdp else ''}tp{tp} pp{pp} cp{cp} vp{vp} b{mbs}"
        try:
            plan = build(model, gpu, gpus, gbs, mbs, fsdp, tp, pp, cp, vp, precision=precision)
        except PlanError as exc:
            print(f"{container:<9}{model:<6}{gpu:<10}{gpus:>5}  {layout:<23}not expressible: "
                  f"{exc}")
            continue
        est = estimate(plan)
        predicted = gbs * SEQ / est.step_time_s / gpus
        error = (predicted - measured) / measured
        errors.append(error)
        ranked.append(((model, gpu), plan, predicted, measured))
        parts = ", ".join(f"{k} {v / est.step_time_s:.0%}"
                          for k, v in est.breakdown.items() if v >= 0.005 * est.step_time_s)
        print(f"{container:<9}{model:<6}{gpu:<10}{gpus:>5}  {layout:<23}{predicted:>7.0f}"
              f"{measured:>7}{error:>+8.1%}  {parts}")
    print(f"\n{len(errors)} of {len(RUNS)} runs expressible; {error_summary(errors)}")
    print(f"ordering (same model and system): {pair_order(ranked)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
