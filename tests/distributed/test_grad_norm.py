"""The gradient norm clipping takes is eager PyTorch's under every layout.

Each rank gives its part of the squared norm, counting every gradient element
once over the ranks that hold it (`ShardedOptimizer.norm_share`), and the
non-finite guard's one all-reduce sums the parts (`health.guarded_update`).
Covered: pure data parallelism at ZeRO-0 (the guard folded into the gradient
all-reduce: each rank's whole square), dp with tp (parameters tp replicates,
the norms, counted 1/tp on each tp rank) at ZeRO-0 (replicated over dp: the
first dp rank's) and ZeRO-1 (each rank's shard), pp (each stage's own) at
ZeRO-0 and ZeRO-2, ZeRO-3, cp (replicated over dp·cp), and routed experts under
ep at ZeRO-0 (the first ep ranks' experts) and ZeRO-1.

The first step's norm (the same weights and samples as eager) is compared with
the norm `clip_grad_norm_` takes of eager PyTorch's gradients in float64. The
bound, 2^-14 relative, is a thousand fp32 roundings (2^-24 each) in series,
more than forward, backward and the reductions of these 2-layer models make;
a gradient counted twice or left out moves the norm by its own share of the
square, percents here.
"""

from __future__ import annotations

import pytest
import torch
from dist_helpers import _eager_loss
from hf_helpers import HFCase, hf_module, hf_plan, run_hf_cases

from ptc.compiler.capture.call import call_rule
from ptc.runtime.data import TokenSource
from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed

CASES = [
    HFCase("llama", dp=4), HFCase("llama", tp=2, dp=2), HFCase("llama", tp=2, dp=2, zero=1),
    HFCase("llama", pp=2, dp=2), HFCase("llama", pp=2, dp=2, zero=2),
    HFCase("llama", dp=4, zero=3), HFCase("llama", cp=2, dp=2),
    HFCase("mixtral", dp=4, ep=2), HFCase("mixtral", dp=4, ep=2, zero=1),
]
RELATIVE = 2.0 ** -14
"""Bound on |ptc's norm − eager's fp64 norm| / eager's (module docstring)."""
_runs: dict = {}


def _results() -> dict:
    if not _runs:
        _runs.update(run_local(run_hf_cases, 4, CASES)[0])
    return _runs


def eager_norm(case: HFCase) -> float:
    """The global gradient norm of eager PyTorch's first step in float64."""
    plan = hf_plan(case)
    model = hf_module(case).double()
    if getattr(model.config, "_experts_implementation", "eager") != "eager":
        model.config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    source = TokenSource(plan.train.data, vocab=model.config.vocab_size,
                         seq_len=plan.train.seq_len)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # tensors the model creates (masks) in float64
    try:
        _eager_loss(model, call_rule(model), source, plan, 0, plan.train.global_batch).backward()
    finally:
        torch.set_default_dtype(default)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=[str(case) for case in CASES])
def test_the_norm_counts_every_gradient_once(case: HFCase) -> None:
    got, want = _results()[case]["norms"][0], eager_norm(case)
    assert got == pytest.approx(want, rel=RELATIVE), (case, got, want)
