"""What each rank keeps for backward under every recompute policy equals the memory model, tp 2.

Measured on 2 gloo processes running the compiled program's stage graph as
the runtime does (`tp_helpers.measure_activations`: what autograd saves,
gathered activations kept as their local chunks under sequence parallelism,
the checkpoint regions' inputs, what a saving region's selective checkpoint
caches), for GPT (written-out attention, LayerNorm, GELU) and Llama (fused
attention, grouped-query, RoPE, RMSNorm, SwiGLU), fp32 and bf16, tp 2 with
and without sequence parallelism, under none, selective, full, ops, each
recompute module alone and all four.

The prediction is `stage_memory(...)["activations"]` of the same plan. It
is exact but for two known terms: the CPU LayerNorm statistics of
`cpu_statistics_gap` (added to the measurement), and the weight total
torch's cross-entropy saves (one scalar of the compute dtype, 4 or 2 bytes),
which the profile counts and the vocabulary-parallel loss of tp does not
keep. Under sequence parallelism two things stay whole on every rank and the
model says so (`SavedClasses.whole`): token ids and targets, and the output
of a row-parallel linear that a saving region (`ops`, `act`) keeps, made
before its reduce-scatter.
"""

from __future__ import annotations

import pytest
from tp_helpers import MemoryCase, measure_activations, predicted_activations

from ptc.plan import ModelSpec
from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed

SPECS = (
    ModelSpec(family="gpt", layers=2, hidden=64, heads=4, vocab=128, max_seq=16),
    ModelSpec(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128,
              max_seq=16),
)
POLICIES = ("none", "selective", "full", "ops", "modules(mlp)", "modules(norm)",
            "modules(act)", "modules(core_attn, mlp, norm, act)")
CASES = [MemoryCase(spec, sp, dtype, policy) for spec in SPECS for sp in (False, True)
         for dtype in ("fp32", "bf16") for policy in POLICIES]
LOSS_SCALAR = {"fp32": 4, "bf16": 2}
"""Bytes of the weight total torch's cross-entropy saves and the vocabulary-parallel one does
not."""
_measured: list = []


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_saved_activations_per_rank_match_the_memory_model(case: MemoryCase) -> None:
    if not _measured:
        _measured.extend(run_local(measure_activations, 2, CASES, 2)[0])
    predicted = predicted_activations(case, 2)
    for rank, (measured, gap) in enumerate(_measured[CASES.index(case)]):
        assert predicted - (measured + gap) == LOSS_SCALAR[case.dtype], \
            f"{case} rank {rank}: predicted {predicted}, measured {measured} + {gap}"
