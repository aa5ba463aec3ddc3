"""Capture time of the Llama-3-70B shape at 8/16/32/80 layers, on the meta device.

Prints, per depth, the median of 3 runs of `ptc.compiler.capture` (bf16,
b=1, s=4096, with the loss), and beside it PyTorch's own way of getting a
shape-annotated graph: `torch.fx.symbolic_trace` + `ShapeProp` on meta
tensors, measured in the same run. ptc does more (loss surgery, NodeInfo
with FLOPs per node); the ratio shows what that costs. Per-layer time
should stay flat as depth grows: identical layers reuse layer 0's meta
evaluation.

    python bench/capture_speed.py [--layers 8 16 32 80] [--repeat 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.fx.passes.shape_prop import ShapeProp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ptc.compiler.capture import capture  # noqa: E402
from ptc.models import build_model  # noqa: E402
from ptc.plan import ModelSpec  # noqa: E402

LLAMA3_70B = ModelSpec(family="llama", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672,
                       vocab=128256, max_seq=8192, rope_theta=500000.0, tied_embeddings=False)
BATCH, SEQ = 1, 4096


def median_time(fn, repeat: int) -> float:
    """Median wall time of `repeat` calls of fn."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torch_baseline(model) -> None:
    """symbolic_trace + ShapeProp on meta tokens (PyTorch's shape-annotated graph)."""
    gm = torch.fx.symbolic_trace(model)
    ShapeProp(gm).propagate(torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta"))


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32, 80])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"Llama-3-70B shape, b={BATCH}, s={SEQ}, bf16, median of {args.repeat}")
    print(f"{'layers':>6}  {'ptc capture':>11}  {'per layer':>9}  {'nodes':>6}  "
          f"{'fx+ShapeProp':>12}  {'ratio':>5}")
    for layers in args.layers:
        spec = dataclasses.replace(LLAMA3_70B, layers=layers)
        model = build_model(spec, device="meta")
        nodes = len(capture(model, micro_batch=BATCH, seq_len=SEQ, dtype="bf16").graph.nodes)
        ours = median_time(lambda: capture(model, micro_batch=BATCH, seq_len=SEQ, dtype="bf16"),
                           args.repeat)
        theirs = median_time(lambda: torch_baseline(model), args.repeat)
        print(f"{layers:>6}  {ours:>10.2f}s  {ours / layers * 1e3:>7.1f}ms  {nodes:>6}  "
              f"{theirs:>11.2f}s  {ours / theirs:>5.2f}")


if __name__ == "__main__":
    main()
