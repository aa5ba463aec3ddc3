"""How long plan search takes: Llama-3-70B on 512 H100s, tp, pp and dp all "auto".

Prints the time to get the model's profile (a one-layer capture at seven
(b, s) points, or a read of the on-disk cache of an earlier run), the time of
`search_all` itself (every layout enumerated, memory-filtered, ranked), and
their sum, the whole search. Each is the best of `--repeat` runs (the first
profile is the cold one and is printed separately); the machine may be
shared, so best-of is the honest figure of the code's own cost.
Usage: python bench/search_speed.py [--repeat N] [--top K]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ptc.compiler.profile import cache as profile_mod  # noqa: E402
from ptc.views.explain import describe_layout  # noqa: E402
from ptc.compiler.search.plan_search import search_all  # noqa: E402
from ptc.compiler.shapes import plan_from_shape  # noqa: E402


def llama70b_plan():
    """Llama-3-70B, seq 4096, batch 1024 sequences, on 64 nodes of 8 H100s, axes auto."""
    return plan_from_shape(family="llama", layers=80, hidden=8192, heads=64, kv_heads=8,
                           ffn=28672, vocab=128256, seq_len=4096, global_batch=1024,
                           gpu="H100-SXM", num_gpus=512, tp="auto", pp="auto", dp="auto")


def main(argv: list[str] | None = None) -> int:
    """Time the profile and the search; print the figures and the top layouts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args(argv)
    plan = llama70b_plan()

    t0 = time.perf_counter()
    profile_mod.model_profile(plan.model, plan.train.dtype)
    first_profile = time.perf_counter() - t0
    profile_times, search_times = [], []
    for _ in range(args.repeat):
        profile_mod._CACHE.clear()  # the in-process cache: measure the disk-cached path
        t0 = time.perf_counter()
        profile_mod.model_profile(plan.model, plan.train.dtype)
        profile_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        result = search_all(plan, args.top)
        search_times.append(time.perf_counter() - t0)

    print(f"Llama-3-70B on {plan.num_gpus} x {plan.hardware.gpu}, tp/pp/dp auto: "
          f"{result.candidates} layouts, {result.fitting} fit, {len(result.rejected)} rejected")
    for rank, (_, est) in enumerate(result.ranked, 1):
        print(f"  {rank}. {describe_layout(est.layout):<48} {est.step_time_s:7.2f} s/step  "
              f"MFU {est.mfu:.1%}  peak {est.peak_memory_bytes / 2**30:.1f} GiB")
    profile_s, search_s = min(profile_times), min(search_times)
    print(f"profile, first in this process (capture, or disk cache): {first_profile:.3f} s")
    print(f"profile from the disk cache: {profile_s:.3f} s")
    print(f"search: {search_s:.3f} s (best of {args.repeat})")
    print(f"whole search (profile from cache + search): {profile_s + search_s:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
