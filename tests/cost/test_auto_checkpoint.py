"""checkpoint = "auto": per stage exact, deterministic across processes, and loud when nothing fits.

The model: a 6-layer GPT cut into 2 pipeline stages under 1F1B with 2
micro-batches, so stage 0 keeps two micro-batches' activations in flight and
stage 1 one. Budgets are derived from the memory model (a stage's peak under
some policy mix), never written down, and set through `memory_margin`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ptc.lower.resolve import resolve
from ptc.lower.driver import capture_plan
from ptc.compiler.search.estimate import estimate, plan_precision
from ptc.compiler.search.fit import largest_micro_batch, smallest_model_parallel
from ptc.compiler.records.layout import layout_of
from ptc.compiler.memory.model import peak, stage_memory
from ptc.lower.driver import compile_plan
from ptc.compiler.profile.cache import model_profile
from ptc.compiler.search.plan_search import search_all
from ptc.errors import CompileError
from ptc.plan import HardwareSpec, ModelSpec, ParallelSpec, Plan, TrainSpec
from ptc.units import format_bytes

ROOT = Path(__file__).resolve().parents[2]
SPEC = ModelSpec(family="gpt", layers=6, hidden=96, heads=4, vocab=256, max_seq=64)
POLICIES = ("none", "selective", "full")
GiB = 2**30


def pp2_plan(checkpoint="auto", *, budget: float | None = None, micro_batch: int = 2) -> Plan:
    """SPEC on 2 GPUs, pp = 2, 1F1B, 4 samples per step; `budget` bytes via memory_margin."""
    hw = HardwareSpec.preset("cpu", gpus_per_node=2)
    if budget is not None:
        hw = dataclasses.replace(hw, memory_margin=hw.hbm_bytes - budget)
    return Plan(model=SPEC, hardware=hw, parallel=ParallelSpec(pp=2, checkpoint=checkpoint),
                train=TrainSpec(seq_len=32, global_batch=4, micro_batch=micro_batch,
                                dtype="fp32"))


def stage_peaks(plan: Plan, policy: tuple[str, ...] | str) -> list[float]:
    """Peak bytes per stage of `plan` with `policy`, from the memory model."""
    profile = model_profile(plan.model, plan.train.dtype)
    mem = stage_memory(profile, layout_of(plan, policy), plan_precision(plan, profile),
                       plan.train.seq_len)
    return [peak(t) for t in mem]


def recompute_flops(policy: tuple[str, ...]) -> float:
    """Recomputed forward FLOPs per sample of a per-layer assignment (the solver's objective)."""
    f = model_profile(SPEC, "fp32").fn
    cost = {"none": 0, "selective": f["core_flops"](1, 32), "full": f["flops.layer"](1, 32)}
    return sum(cost[p] for p in policy)


def brute_force(plan: Plan) -> tuple[float, list[tuple[str, ...]]]:
    """The least recompute over all 3^L per-layer assignments that fit, and the ones reaching it."""
    budget = plan.hardware.memory_budget
    fitting = [a for a in itertools.product(POLICIES, repeat=SPEC.layers)
               if max(stage_peaks(plan, a)) <= budget]
    least = min(recompute_flops(a) for a in fitting)
    return least, [a for a in fitting if recompute_flops(a) == least]


def stage_counts(policy: tuple[str, ...], stage: int) -> dict[str, int]:
    """How many of `stage`'s layers take each policy."""
    layers = layout_of(pp2_plan("none")).stage_layers(stage)
    return {p: sum(policy[i] == p for i in layers) for p in POLICIES}


def budgets() -> dict[str, float]:
    """Budgets named by how they are derived (each one a stage's peak under some mix)."""
    base = pp2_plan("none")
    sel2 = ("selective", "selective", "none") * 2
    return {
        "stage1_fits_uncheckpointed": stage_peaks(base, "none")[1],
        "stage1_selective_two_of_three": stage_peaks(base, sel2)[1],
        "stage0_one_full": stage_peaks(base, ("full", "none", "none") * 2)[0],
    }


@pytest.mark.parametrize("name", list(budgets()))
def test_auto_per_stage_equals_brute_force(name: str) -> None:
    """Exactness: auto's per-layer choice is an optimum of the exhaustive search, per stage."""
    plan = pp2_plan(budget=budgets()[name])
    chosen = estimate(plan).layout.checkpoint
    least, optima = brute_force(plan)
    assert chosen in optima and recompute_flops(chosen) == least
    # The optimum is unique up to which layers of a stage take which policy.
    for stage in (0, 1):
        assert {tuple(stage_counts(a, stage).items()) for a in optima} \
            == {tuple(stage_counts(chosen, stage).items())}
    # Stage 0 holds two micro-batches in flight, stage 1 one: stage 0 recomputes more.
    per_stage = [recompute_flops(tuple(chosen[i] for i in layout_of(plan).stage_layers(s)))
                 for s in (0, 1)]
    assert per_stage[0] > per_stage[1]
    assert policies(plan) == chosen



def policies(plan) -> tuple[str, ...]:
    """The per-layer policies compiling `plan` resolves (the Decisions record's)."""
    return resolve(capture_plan(plan), plan).checkpoint


def test_stages_get_different_mixes() -> None:
    """Stage 1 just fits with two selective layers: both stages recompute, differently."""
    plan = pp2_plan(budget=budgets()["stage1_selective_two_of_three"])
    chosen = estimate(plan).layout.checkpoint
    assert stage_counts(chosen, 0) != stage_counts(chosen, 1)
    assert any(p != "none" for p in chosen[3:])
    assert estimate(plan).fits


def test_margin_is_taken_off_the_budget() -> None:
    """The same plan fits without the margin and not with it; search agrees with estimate."""
    need = stage_peaks(pp2_plan("none"), "none")
    plan = pp2_plan("none", budget=max(need) - 1)
    est = estimate(plan)
    assert not est.fits and est.budget_bytes == max(need) - 1
    assert est.hbm_bytes == plan.hardware.hbm_bytes
    assert est.margin_bytes == plan.hardware.memory_margin
    assert estimate(pp2_plan("none")).fits
    result = search_all(plan, top=50)
    for rejected in result.rejected:
        assert rejected.over_bytes == pytest.approx(rejected.peak_bytes - (max(need) - 1))
    for _, fitting in result.ranked:
        assert fitting.peak_memory_bytes <= max(need) - 1


def nothing_fits_plan() -> Plan:
    """A budget where stage 1 fits fully recomputed and stage 0 does not (by its difference)."""
    full = stage_peaks(pp2_plan("none"), "full")
    assert full[0] > full[1]
    return pp2_plan(budget=full[1])


def test_nothing_fits_raises_on_compile_with_the_numbers_and_what_would_fit() -> None:
    plan = nothing_fits_plan()
    full = stage_peaks(plan, "full")
    mb, mp = largest_micro_batch(plan), smallest_model_parallel(plan)
    with pytest.raises(CompileError) as info:
        compile_plan(plan)
    text = str(info.value)
    assert f"stage 0 needs {full[0] / GiB:.3f} GiB with every layer fully recomputed, " \
           f"{format_bytes(full[0] - full[1])} over the budget of {full[1] / GiB:.3f} GiB" in text
    assert "stage 1 needs" not in text  # it fits
    assert f"memory_margin {plan.hardware.memory_margin / GiB:.3f} GiB" in text
    assert f"largest micro-batch {mb if mb is not None else 'none'} (now 2)" in text
    assert f"smallest tp x pp {f'tp{mp[0]} x pp{mp[1]}' if mp else 'none'} on 2 GPUs" in text
    # The suggestions are true. 4 samples per step over pp 2 leave micro-batches 1 and 2,
    # and 2 does not fit: the answer must be 1, and with it auto fits.
    assert mb == 1
    assert estimate(dataclasses.replace(plan, train=dataclasses.replace(
        plan.train, micro_batch=mb))).fits
    assert mp is not None and mp[0] * mp[1] <= 2
    assert estimate(dataclasses.replace(plan, parallel=dataclasses.replace(
        plan.parallel, tp=mp[0], pp=mp[1], dp=2 // (mp[0] * mp[1])))).fits
    # Resolving the plan for compiling raises, before any pass.
    with pytest.raises(CompileError, match="checkpoint = auto: nothing fits"):
        policies(plan)


def test_nothing_fits_is_reported_not_raised_by_estimate_and_search() -> None:
    plan = nothing_fits_plan()
    est = estimate(plan)
    assert not est.fits
    assert est.layout.checkpoint[:3] == ("full",) * 3  # stage 0 at its least memory
    result = search_all(plan, top=3)
    assert result.candidates == result.fitting + len(result.rejected)
    full = stage_peaks(plan, "full")
    own = [r for r in result.rejected if r.layout == layout_of(plan, "full")]
    assert len(own) == 1 and own[0].over_bytes == pytest.approx(full[0] - full[1])


def test_nothing_fits_says_none_when_nothing_would() -> None:
    plan = pp2_plan(budget=min(stage_peaks(pp2_plan("none"), "full")) / 2)
    with pytest.raises(CompileError) as info:
        policies(plan)
    assert "largest micro-batch none" in str(info.value)
    assert "smallest tp x pp none on 2 GPUs" in str(info.value)


_CHILD = """
import json, sys
sys.path.insert(0, {root!r})
from tests.cost.test_auto_checkpoint import budgets, pp2_plan, SPEC
from tests.cost.test_auto_checkpoint import policies
print(json.dumps(list(policies(pp2_plan(budget=budgets()[{name!r}])))))
"""


def test_auto_is_the_same_in_every_process() -> None:
    """Two processes with different hash seeds and ranks decide the same per-layer policies."""
    name = "stage1_selective_two_of_three"
    out = []
    for seed, rank in (("1", "0"), ("4242", "1")):
        env = {**os.environ, "PYTHONHASHSEED": seed, "RANK": rank}
        run = subprocess.run([sys.executable, "-c", _CHILD.format(root=str(ROOT), name=name)],
                             env=env, capture_output=True, text=True, timeout=120, check=True)
        out.append(json.loads(run.stdout.strip().splitlines()[-1]))
    assert out[0] == out[1]
    assert out[0] == list(estimate(pp2_plan(budget=budgets()[name])).layout.checkpoint)
    assert len(set(out[0])) > 1  # a real mix, not a uniform policy


@pytest.mark.parametrize("name", list(budgets()))
def test_auto_over_every_policy_beats_or_equals_the_three_and_is_exact(name: str) -> None:
    """`auto_checkpoint(..., policies=LAYER_POLICIES)`: op-level and module recompute are
    candidates too. Its choice fits, recomputes no more than the three-policy choice, and is
    the least recompute over every assignment to a stage's layers of at most two recomputing
    policies beside "none" (what it enumerates), checked by brute force per stage. With 16
    policies a mix of three can do better (it does under one of these budgets): its search
    space is the pairs, not every assignment."""
    from ptc.compiler.cost.step import policy_flops  # noqa: PLC0415
    from ptc.compiler.search.estimate import auto_checkpoint  # noqa: PLC0415
    from ptc.compiler.graph.recompute_regions import LAYER_POLICIES  # noqa: PLC0415

    plan = pp2_plan(budget=budgets()[name])
    profile = model_profile(SPEC, "fp32")
    prec = plan_precision(plan, profile)

    def flops(policy: tuple[str, ...]) -> float:
        return sum(policy_flops(profile, p, 1, 32) for p in policy)

    runs = [auto_checkpoint(profile, layout_of(plan, "none"), prec, 32,
                            plan.hardware.memory_budget, LAYER_POLICIES).checkpoint
            for _ in range(2)]
    chosen = runs[0]
    assert runs[0] == runs[1]
    # The plan language's spelling: checkpoint = auto(all), estimated and compiled alike.
    auto_all = pp2_plan("auto(all)", budget=budgets()[name])
    assert estimate(auto_all).layout.checkpoint == chosen == policies(auto_all)
    assert max(stage_peaks(plan, chosen)) <= plan.hardware.memory_budget
    assert flops(chosen) <= flops(estimate(plan).layout.checkpoint)
    usable = [p for p in LAYER_POLICIES if p not in profile.unavailable]
    layers = layout_of(plan, "none")
    for stage in range(2):
        own = layers.stage_layers(stage)
        best = None
        for mix in itertools.product(usable, repeat=len(own)):
            if len(set(mix) - {"none"}) > 2:
                continue
            policy = list(chosen)
            for layer, pol in zip(own, mix):
                policy[layer] = pol
            if stage_peaks(plan, tuple(policy))[stage] <= plan.hardware.memory_budget:
                best = flops(mix) if best is None else min(best, flops(mix))
        assert flops(tuple(chosen[i] for i in own)) == best, f"stage {stage}"


def test_norm_recompute_under_sequence_parallelism_prices_its_rerun_all_gathers() -> None:
    """Under sequence parallelism backward needs each entry's gathered input again (the
    column-parallel linears' weight gradients): without recompute the runtime kept only the
    rank's chunk and gathers it again (`ptc.ops.seq_regather`), and a region recomputing a
    norm's output reruns that all-gather instead (2 per layer: attention and MLP norms), so
    the two price the same, both 2 all-gathers a layer above the collectives of the pairs;
    a module region without a norm regathers as without recompute; without sequence
    parallelism the entry is an identity. `ptc explain` names the reruns in the
    checkpointing table."""
    from ptc.compiler.cost import collectives as comm  # noqa: PLC0415
    from ptc.compiler.cost.topology import axis_placements  # noqa: PLC0415

    spec = ModelSpec(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128,
                     vocab=128, max_seq=16)

    def tp_comm(policy: str, sp: bool) -> float:
        plan = Plan(model=spec, hardware=HardwareSpec.preset("H100-SXM", gpus_per_node=2),
                    parallel=ParallelSpec(tp=2, sequence_parallel=sp, checkpoint=policy,
                                          overlap=False),
                    train=TrainSpec(seq_len=16, global_batch=2, micro_batch=2))
        return estimate(plan).breakdown["tp_comm"], plan

    hw = HardwareSpec.preset("H100-SXM", gpus_per_node=2)
    group = axis_placements({"tp": 2, "cp": 1, "pp": 1, "dp": 1}, ("tp", "cp", "dp", "pp"),
                        hw.gpus_per_node)["tp"]
    size = 2 * 2 * 16 * 64  # bf16 b·s·h
    gather = comm.all_gather(size, group, hw).seconds
    pair = comm.reduce_scatter(size, group, hw).seconds + gather
    none, _ = tp_comm("none", True)
    # Per layer 2 entries and 2 exits, each a pair forward or backward, and 2 gathers again;
    # the vocabulary-parallel embedding's and head's one pair.
    assert none == pytest.approx(2 * (4 * pair + 2 * gather) + pair, rel=1e-9)
    norm, plan = tp_comm("modules(norm)", True)
    assert norm == pytest.approx(none, rel=1e-9)
    assert tp_comm("modules(mlp)", True)[0] == none
    assert tp_comm("modules(norm)", False)[0] == tp_comm("none", False)[0]
    from rich.console import Console  # noqa: PLC0415

    from ptc.views.explain import render_explain  # noqa: PLC0415

    console = Console(width=200, record=True)
    console.print(render_explain(plan))
    assert "4 all-gathers again" in console.export_text()
