"""The cut that compiles is the cut that is priced.

The pipeline cut is a decision of the cost model, made once before the passes
(`ptc.compiler.search.estimate.balanced_cut`, called by `resolve`) and pinned into
`Program.decisions.plan`; the pipeline_split pass applies it. So the
Program's predicted step time and per-stage memory are those of a fresh
`ptc.estimate` of the plan, and of the plan with the compiled cut pinned, and
the stage graphs hold the layers the estimate priced. The plans below are cut
unevenly for different reasons: a head over a large vocabulary (tied to the
embedding, so both end stages hold it), interleaved stages, a memory budget
the even split overflows, and cuts the plan pins itself.
"""

from __future__ import annotations

import dataclasses

import pytest

import ptc
from ptc.plan import HardwareSpec, ModelSpec, ParallelSpec, Plan, TrainSpec

pytestmark = pytest.mark.timeout(300)


def make_plan(*, pp: int = 2, v: int = 1, layers: int = 8, vocab: int = 32768,
              family: str = "gpt", hbm: float | None = None, **pins) -> Plan:
    """A small model on one H100 node: big enough that its head costs several layers."""
    hardware = HardwareSpec.preset("H100-SXM", gpus_per_node=8)
    if hbm is not None:
        hardware = dataclasses.replace(hardware, hbm_bytes=hbm, memory_margin=0)
    extra = dict(kv_heads=2, ffn=512) if family == "llama" else {}
    return Plan(model=ModelSpec(family=family, layers=layers, hidden=128, heads=4, vocab=vocab,
                                max_seq=512, **extra),
                hardware=hardware,
                parallel=ParallelSpec(pp=pp, dp=8 // pp, virtual_stages=v,
                                      schedule="interleaved" if v > 1 else "1f1b", **pins),
                train=TrainSpec(seq_len=512, global_batch=8 // pp * 8, micro_batch=1,
                                dtype="bf16"))


def with_ends(plan: Plan, first: int, last: int | None = None) -> Plan:
    """`plan` with the first (and last) pipeline rank's layer counts pinned."""
    return dataclasses.replace(plan, parallel=dataclasses.replace(
        plan.parallel, first_stage_layers=first, last_stage_layers=last))


def compiled_layers(program) -> list[int]:
    """Layers each stage graph of the Program holds, stage 0 first."""
    return [sum(atom.startswith("layers.") for atom in stage.info.atoms)
            for stage in program.stages]


def priced_layers(est) -> list[int]:
    """Layers each stage holds in the estimate's layout (stage c runs on rank c % p)."""
    layout = est.layout
    return [len(layout.chunks(c % layout.pp)[c // layout.pp])
            for c in range(layout.pp * layout.vstages)]


def assert_one_cost_path(plan: Plan):
    """Compile `plan` and check that its Program predicts what a fresh estimate predicts, for
    the cut the stage graphs hold; return the Program."""
    program = ptc.compile(None, plan)
    decided = program.decisions
    fresh = ptc.estimate(plan)
    of_the_cut = ptc.estimate(decided.plan)
    for est in (fresh, of_the_cut):
        assert est.step_time_s == decided.estimate.step_time_s
        assert est.stage_memory_bytes == decided.estimate.stage_memory_bytes
        assert est.breakdown == decided.estimate.breakdown
    assert compiled_layers(program) == priced_layers(decided.estimate)
    return program


@pytest.mark.parametrize("family,pp,v", [("gpt", 2, 1), ("gpt", 2, 2), ("llama", 4, 1)])
def test_a_costly_head_gets_fewer_layers_beside_it(family: str, pp: int, v: int) -> None:
    plan = make_plan(family=family, pp=pp, v=v)
    program = assert_one_cost_path(plan)
    per_rank = [sum(compiled_layers(program)[c] for c in range(rank, pp * v, pp))
                for rank in range(pp)]
    even = 8 // pp
    assert per_rank[-1] < even, per_rank  # the last rank also runs the head and the loss
    pinned_even = with_ends(plan, even, None if pp == 2 else even)
    assert program.decisions.estimate.step_time_s < ptc.estimate(pinned_even).step_time_s


def test_a_memory_budget_the_even_split_overflows_moves_the_cut() -> None:
    """Under 1F1B rank 0 keeps pp micro-batches in flight, the last rank one: with a budget
    that the even split's rank 0 overflows, layers move off rank 0 until it fits."""
    plan = make_plan(vocab=512)
    assert compiled_layers(ptc.compile(None, plan)) == [4, 4]  # nothing to gain: even
    even = ptc.estimate(plan)
    first, last = even.stage_memory_bytes
    assert first > last
    moved = max(ptc.estimate(with_ends(plan, 3)).stage_memory_bytes)  # a layer off rank 0
    assert moved < first
    tight = make_plan(vocab=512, hbm=(first + moved) / 2)
    assert not ptc.estimate(with_ends(tight, 4)).fits
    program = assert_one_cost_path(tight)
    assert program.decisions.estimate.fits
    assert compiled_layers(program)[0] < 4


@pytest.mark.parametrize("pins,layers", [
    (dict(first_stage_layers=3), [3, 5]),
    (dict(stage_boundaries=("layers.5",)), [5, 3]),
])
def test_a_cut_the_plan_pins_is_the_one_compiled_and_priced(pins: dict, layers: list) -> None:
    plan = make_plan(**pins)
    program = assert_one_cost_path(plan)
    assert program.decisions.plan == plan
    assert compiled_layers(program) == layers
