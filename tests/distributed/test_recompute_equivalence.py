"""Activation checkpointing on 2 gloo processes trains like plain PyTorch, under every policy.

Layouts (all on 2 processes, one launch): dp 2 with ZeRO-1 and ZeRO-3, tp 2,
pp 2 (1F1B, 2 micro-batches). Policies: full, selective, ops, modules(...),
a per-layer mix,
and "auto" under a budget (`recompute_worker.auto_budget`) where it
resolves to a mix that differs between the pipeline's stages. Models: the
tiny GPT (written-out attention) and Llama (fused SDPA, grouped-query).

Numerics: the losses of every step and the parameters after training equal
single-process AdamW on the eager model (the reference of dist_helpers),
within the tolerances `tests/tolerances.py` derives from the same training
in float64. Determinism: every rank compiles the plan itself; the per-layer
policies read off each rank's compiled graphs are gathered and must be
equal, and equal to what was asked (for "auto", to the estimate's choice).
"""

from __future__ import annotations

import pytest
from dist_helpers import assert_same_training, reference
from recompute_worker import RecomputeCase, recompute_plan, run_recompute_cases

from ptc.compiler.search.estimate import estimate
from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed

CASES = [
    RecomputeCase("gpt", "dp2", "full", zero=1),
    RecomputeCase("llama", "dp2", "full", zero=1),
    RecomputeCase("llama", "dp2", "full", zero=3),
    RecomputeCase("gpt", "dp2", "selective", zero=1),
    RecomputeCase("llama", "dp2", "selective", zero=3),
    RecomputeCase("gpt", "dp2", ("selective", "full"), zero=3),
    RecomputeCase("llama", "dp2", ("full", "none"), zero=1),
    RecomputeCase("gpt", "tp2", "full"),
    RecomputeCase("gpt", "tp2", "selective"),
    RecomputeCase("llama", "tp2", "full"),
    RecomputeCase("llama", "tp2", "selective"),
    RecomputeCase("gpt", "pp2", "full"),
    RecomputeCase("gpt", "pp2", "selective"),
    RecomputeCase("llama", "pp2", "full"),
    RecomputeCase("llama", "pp2", "selective"),
    RecomputeCase("gpt", "pp2", "auto"),
    RecomputeCase("gpt", "dp2", "ops", zero=1),
    RecomputeCase("llama", "dp2", "modules(core_attn, mlp, norm, act)", zero=3),
    RecomputeCase("gpt", "tp2", "ops"),
    RecomputeCase("llama", "tp2", "modules(norm, act)"),
    RecomputeCase("llama", "pp2", ("ops", "modules(mlp)", "none", "modules(norm)")),
]
_run: dict = {}


def _results() -> dict:
    if not _run:
        _run.update(run_local(run_recompute_cases, 2, CASES)[0])
    return _run


def expected_policies(case: RecomputeCase) -> tuple[str, ...]:
    """Per layer, the policy the case asks for ("auto": the estimate's choice)."""
    plan = recompute_plan(case)
    if case.checkpoint == "auto":
        return estimate(plan).layout.checkpoint
    if isinstance(case.checkpoint, str):
        return (case.checkpoint,) * plan.model.layers
    return case.checkpoint


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_checkpointed_training_matches_single_process_adamw(case: RecomputeCase) -> None:
    got = _results()[case]
    assert_same_training(got, reference(recompute_plan(case)), what=str(case))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_every_rank_applies_the_same_policies(case: RecomputeCase) -> None:
    ranks = _results()[case]["policies"]
    assert len(ranks) == 2 and ranks[0] == ranks[1], f"{case}: ranks decided {ranks}"
    assert ranks[0] == expected_policies(case)


def test_auto_resolves_to_a_mix_that_differs_per_stage() -> None:
    """The auto case is not a uniform policy in disguise: stage 0 recomputes, stage 1 does not."""
    case = next(c for c in CASES if c.checkpoint == "auto")
    policies = expected_policies(case)
    assert "full" in policies[:2] and policies[2:] == ("none", "none")
