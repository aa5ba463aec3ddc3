"""Score ptc's cost model on BF16 runs no preset was set by: NVIDIA's DGX Cloud Llama 3.1 recipes.

`bench/validate_cost_model.py` scores the runs the presets' `achievable_fraction` is
solved from; `bench/validate_out_of_sample.py` scores Megatron-Bridge's FP8 runs. This
script scores the same mechanisms, unchanged, on the BF16 rows of another suite: the
Llama 3.1 pre-training recipe of NVIDIA's DGX Cloud Benchmarking Recipes
(github.com/NVIDIA/dgxc-benchmarking), its "Expected Performance" tables, one release for
each distinct set of measurements (the releases between repeat the tables; later ones
give none):
- v24.11.1 (commit 35a9aecc8d5b): llama3.1/README_8b.md, README_70b.md and README_405b.md,
  tables titled NeMo 24.09 (v25.01 and v25.01.1 repeat them);
- v25.02 (commit 8f5cbb3799ea): the same three files (repeated up to v25.03);
- v25.04 (commit 741c886025a7): llama3.1/README.md, its layout table and its tables
  (repeated in v25.04.01 and v25.04.02);
- v25.05.01 (commit 60d6fd33ba95): llama3.1/README.md, 405B on GB200 and on H100
  (v25.05 has the GB200 rows alone; v25.05.02 to v25.05.05 repeat them).
The tables give seconds per training step on H100 (DGX H100) and GB200 GPUs; the score
is their throughput per GPU, sequence length (8192) x global batch / step / GPUs.

Each row is built as its table states it (GPUs, layers, global batch, TP, PP, CP, VP;
micro-batch 1), with Megatron-Bridge's rules for the rest, the same for every row
(bench/validate_out_of_sample.py): Llama 3.1 shapes, flash attention, no dropout, untied
embeddings, no activation recompute, the distributed optimizer (ZeRO-1), sequence
parallelism when tp > 1 with tp communication overlap (`tp_comm = async`), communication
overlapped, fused memory-bound kernels, the even
pipeline cut or, where pp does not divide the layers, the cut that counts the embedding
and the loss as a layer each; interleaving when VP is given; runs of more than 72 GPUs on
GB200 use 64 of each NVL72 rack. In BF16 with fp32 main gradients, on the "H100-SXM" and
"GB200" presets. v24.11.1's configuration files (llama3.1/llama3.1_*.yaml) state the
same: no recompute, sequence parallelism when tp > 1, the distributed optimizer with
overlapped gradient and parameter syncs, no dropout, untied embeddings. The 405B rows on
fewer GPUs than the whole model needs run the recipes' proxies, the model cut to the
layers the table states (7, 21 and 42 in v24.11.1 and v25.02; 8, 30 and 62 in v25.04).

It prints each row, per release the median and max |error|, then the median, p90 and max
|error|, the rows within 10 % and 25 %, and the ordering of pairs as
`validate_out_of_sample.py` counts it (pairs of one model, at one layer count, on one
system).

Usage: python bench/validate_held_out.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ptc.compiler.search.estimate import estimate  # noqa: E402
from ptc.errors import PlanError  # noqa: E402
from validate_cost_model import error_summary  # noqa: E402
from validate_out_of_sample import LLAMA3, SEQ, build, pair_order  # noqa: E402


def _weak(release: str, model: str, first: int, batch_per_gpu: int, tp: int, pp: int, cp: int,
          vp: int, steps: list[float]) -> list[tuple]:
    """The H100 rows of one weak-scaling table: `first` GPUs doubled once per measured step
    time, the global batch `batch_per_gpu` per GPU, the layout fixed."""
    return [(release, model, LLAMA3[model]["layers"], "H100-SXM", first << i,
             batch_per_gpu * (first << i), tp, pp, cp, vp, step)
            for i, step in enumerate(steps)]


RUNS = [  # release, model, layers, system, GPUs, GBS, TP, PP, CP, VP, seconds per step
    *_weak("v24.11.1", "8B", 8, 16, 1, 1, 2, 1, [12.91, 13.00, 13.05, 13.08, 13.10]),
    *_weak("v24.11.1", "70B", 64, 2, 4, 4, 2, 5, [14.72, 14.73, 14.8, 14.89, 14.92, 14.98]),
    ("v24.11.1", "405B", 7, "H100-SXM", 32, 126, 8, 1, 2, 1, 8.85),
    ("v24.11.1", "405B", 21, "H100-SXM", 96, 126, 8, 3, 2, 7, 8.75),  # printed "8.7  5"
    ("v24.11.1", "405B", 42, "H100-SXM", 192, 252, 8, 3, 2, 7, 16.93),
    ("v24.11.1", "405B", 126, "H100-SXM", 576, 252, 8, 9, 2, 7, 17.20),
    ("v24.11.1", "405B", 126, "H100-SXM", 1152, 504, 8, 9, 2, 7, 17.52),
    ("v24.11.1", "405B", 126, "H100-SXM", 2304, 1008, 8, 9, 2, 7, 17.62),
    *_weak("v25.02", "8B", 8, 16, 1, 1, 2, 1, [12.78, 12.99, 13.00, 13.00, 13.16]),
    *_weak("v25.02", "70B", 64, 2, 4, 4, 2, 5, [14.61, 14.70, 14.72, 14.80, 14.86, 14.84]),
    ("v25.02", "405B", 7, "H100-SXM", 32, 126, 8, 1, 2, 1, 9.00),
    ("v25.02", "405B", 21, "H100-SXM", 96, 126, 8, 3, 2, 7, 8.87),
    ("v25.02", "405B", 42, "H100-SXM", 192, 252, 8, 3, 2, 7, 17.30),
    ("v25.02", "405B", 126, "H100-SXM", 576, 252, 8, 9, 2, 7, 17.50),
    ("v25.02", "405B", 126, "H100-SXM", 1152, 504, 8, 9, 2, 7, 17.60),
    ("v25.02", "405B", 126, "H100-SXM", 2304, 1008, 8, 9, 2, 7, 17.70),
    *_weak("v25.04", "8B", 8, 16, 1, 1, 2, 1, [12.27, 12.3, 12.32, 12.33, 12.33]),
    *_weak("v25.04", "70B", 64, 2, 4, 4, 2, 5, [14.66, 14.67, 14.68, 14.67, 14.65, 14.66]),
    ("v25.04", "405B", 8, "H100-SXM", 32, 64, 8, 1, 2, 1, 5.4),
    ("v25.04", "405B", 30, "H100-SXM", 64, 64, 8, 4, 2, 8, 10.1),
    ("v25.04", "405B", 62, "H100-SXM", 128, 128, 8, 4, 2, 8, 19.62),
    ("v25.04", "405B", 126, "H100-SXM", 512, 256, 8, 8, 2, 8, 19.78),
    ("v25.04", "405B", 126, "H100-SXM", 1024, 512, 8, 8, 2, 8, 19.84),
    ("v25.04", "405B", 126, "H100-SXM", 2048, 1024, 8, 8, 2, 8, 19.87),
    ("v25.05.01", "405B", 126, "GB200", 128, 64, 4, 8, 2, 8, 9.347),
    ("v25.05.01", "405B", 126, "GB200", 256, 128, 4, 8, 2, 8, 9.484),
    ("v25.05.01", "405B", 126, "GB200", 512, 256, 4, 8, 2, 8, 9.508),
    ("v25.05.01", "405B", 126, "H100-SXM", 512, 256, 8, 8, 2, 8, 19.810),
]
"""The BF16 rows of the DGX Cloud Llama 3.1 recipe's tables (module docstring)."""


def main() -> int:
    """Print each row's predicted and measured tokens/s per GPU, per release the median and
    max |error|, then the error summary and the ordering of pairs."""
    print(f"{'release':<10}{'model':<6}{'L':>4} {'gpu':<9}{'gpus':>5}  layout{'':<18}"
          f"{'pred':>7}{'meas':>7}{'err':>8}  step parts")
    errors, ranked, by_release = [], [], {}
    for release, model, layers, gpu, gpus, gbs, tp, pp, cp, vp, step in RUNS:
        layout = f"tp{tp} pp{pp} cp{cp} vp{vp} gbs{gbs}"
        head = f"{release:<10}{model:<6}{layers:>4} {gpu:<9}{gpus:>5}  {layout:<24}"
        try:
            plan = build(model, gpu, gpus, gbs, 1, 0, tp, pp, cp, vp, dtype="bf16",
                         layers=layers)
        except PlanError as exc:
            print(f"{head}not expressible: {exc}")
            continue
        est = estimate(plan)
        predicted, measured = (gbs * SEQ / t / gpus for t in (est.step_time_s, step))
        error = (predicted - measured) / measured
        errors.append(error)
        by_release.setdefault(release, []).append(abs(error))
        ranked.append(((model, layers, gpu), plan, predicted, measured))
        parts = ", ".join(f"{k} {v / est.step_time_s:.0%}"
                          for k, v in est.breakdown.items() if v >= 0.005 * est.step_time_s)
        print(f"{head}{predicted:>7.0f}{measured:>7.0f}{error:>+8.1%}  {parts}")
    print("\nper release: rows, median |error|, max |error|")
    for release, errs in by_release.items():
        print(f"  {release:<10}{len(errs):>4} {statistics.median(errs):>8.1%} {max(errs):>8.1%}")
    print(f"\n{len(errors)} of {len(RUNS)} runs expressible; {error_summary(errors)}")
    print(f"ordering (same model, layers and system): {pair_order(ranked)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
