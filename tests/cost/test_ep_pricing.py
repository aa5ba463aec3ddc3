"""Expert parallelism priced: what a rank holds, and what its all-to-alls are handed.

The memory model counts 1/ep of the routed experts held whole on a rank (the
weights at ZeRO 0-2, the gradients at ZeRO 0-1, the optimizer at ZeRO-0) and
the same ZeRO shards as without ep (1/ep of the experts over dp/ep ranks):
its weights and gradients equal `Program.state_bytes` — the layout the
runtime holds, itself equal to the runtime's bytes in
tests/distributed/test_ep_equivalence.py — exactly, and its optimizer too but
for Adam's 4-byte step counter per tensor, which the program's figure leaves
out. The step's all-to-alls are handed, on the mean rank, the bytes
`ep_bytes_per_step` predicts: counted at the collectives of a real step on 2
and 4 gloo processes. A dispatch is handed all of a rank's routed rows, a
combine the rows its experts received, which the router decides: each rank's
own figure varies, their sum over the ranks does not.
"""

from __future__ import annotations

import dataclasses
import io
import sys
from pathlib import Path

import pytest
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from hf_helpers import HFCase, hf_module, hf_plan, record_ep_step  # noqa: E402

from ptc.compiler.cost.step import ep_bytes_per_step, ep_rows_bytes  # noqa: E402
from ptc.compiler.search.estimate import plan_precision  # noqa: E402
from ptc.compiler.search.plan_search import search_all  # noqa: E402
from ptc.compiler.profile.cache import plan_profile, with_model_shape  # noqa: E402
from ptc.compiler.records.layout import layout_of  # noqa: E402
from ptc.lower.driver import compile_plan  # noqa: E402
from ptc.runtime.launcher import run_local  # noqa: E402
from ptc.units import format_bytes  # noqa: E402
from ptc.views.explain import render_explain  # noqa: E402

MEMORY = [HFCase("mixtral", dp=2), HFCase("mixtral", dp=2, ep=2), HFCase("mixtral", dp=4, ep=4),
          HFCase("mixtral", dp=4, ep=2, zero=1), HFCase("mixtral", dp=4, ep=2, zero=2),
          HFCase("mixtral", dp=4, ep=2, zero=3), HFCase("mixtral", tp=2, dp=2, ep=2),
          HFCase("qwen3_moe", dp=4, ep=4, dtype="bf16"),
          HFCase("qwen3_moe", dp=4, ep=2, zero=1, dtype="bf16")]


@pytest.mark.parametrize("case", MEMORY, ids=str)
def test_predicted_state_is_what_the_layout_holds(case: HFCase) -> None:
    program = compile_plan(hf_plan(case), model=hf_module(case))
    assert program.decisions.estimate is not None, program.decisions.unpriced
    predicted = program.decisions.estimate.memory_terms[0]
    held = program.state_bytes()
    assert predicted["weights"] == held["params"]
    assert predicted["grads"] == held["grads"]
    tensors = sum(1 for _ in program.model.parameters())
    counters = 4 * tensors / (program.plan.grad_ranks if program.plan.parallel.zero >= 1 else 1)
    assert predicted["optimizer"] == held["optimizer"] + counters


def test_expert_parallelism_is_priced_as_its_all_to_alls() -> None:
    """ep_comm is there with ep and only with it; a rank holds fewer bytes."""
    one, two = (compile_plan(hf_plan(c), model=hf_module(c)).decisions.estimate
                for c in (HFCase("mixtral", dp=2), HFCase("mixtral", dp=2, ep=2)))
    assert one.breakdown["ep_comm"] == 0.0 < two.breakdown["ep_comm"]
    assert two.memory_terms[0]["weights"] < one.memory_terms[0]["weights"]


BYTES = {2: [HFCase("mixtral", dp=2, ep=2), HFCase("qwen3_moe", dp=2, ep=2, checkpoint="full")],
         4: [HFCase("mixtral", dp=4, ep=4), HFCase("mixtral", tp=2, dp=2, ep=2),
             HFCase("mixtral", dp=4, ep=2, config=(("num_experts_per_tok", 1),)),
             HFCase("mixtral_one_sided", dp=4, ep=4), HFCase("llama", tp=2, dp=2)]}
_recorded: dict = {}


def _step_bytes(world: int) -> dict:
    """`record_ep_step` of BYTES[world], run once per world size."""
    if world not in _recorded:
        _recorded[world] = run_local(record_ep_step, world, BYTES[world])[0]
    return _recorded[world]


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", sorted(BYTES))
def test_all_to_all_bytes_are_the_cost_models(world: int) -> None:
    """And the step reports how many rows each expert got: their mean is the ep group's
    b·s·k rows over the experts it shares out; routers frozen at zero send every row to
    experts 0 and 1 (a top-2 of ties), none to 2 and 3."""
    got = _step_bytes(world)
    for case in (c for c in BYTES[world] if c.ep > 1):
        plan = with_model_shape(hf_plan(case))
        profile = plan_profile(plan)
        predicted = ep_bytes_per_step(profile, layout_of(plan), plan_precision(plan, profile),
                                      plan.train.seq_len)
        assert predicted > 0
        assert sum(got[case]["sent"]) == predicted * world, case
        low, mean, high = got[case]["expert_tokens"]
        tokens = plan.train.micro_batch * plan.train.seq_len * profile.routed_rows
        assert low <= mean == tokens * case.ep / 4 <= high, case  # 4 experts
        if case.model == "mixtral_one_sided":
            assert (low, high) == (0, 2 * mean), case


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_tp_all_reduces_of_routed_rows_are_priced_at_their_rows() -> None:
    """Under tp the experts' entry and exit all-reduce the routed rows, top-k of them per
    token: Mixtral's layers hand the tp group k = 2 boundaries more per entry and exit than
    Llama's of the same width (whose embedding, head and loss hand it the same bytes), and
    the profile counts exactly that (entries and exits in boundaries moved)."""
    got = _step_bytes(4)
    moe, dense = HFCase("mixtral", tp=2, dp=2, ep=2), HFCase("llama", tp=2, dp=2)

    def layer_bytes(case: HFCase) -> float:
        plan = with_model_shape(hf_plan(case))
        profile, train = plan_profile(plan), plan.train
        boundary = train.micro_batch * train.seq_len * profile.hidden * profile.dtype_bytes
        micro_batches = train.global_batch // (train.micro_batch * plan.parallel.dp)
        return ((profile.tp_entries + profile.tp_exits) * boundary * plan.model.layers
                * micro_batches)

    profile = plan_profile(with_model_shape(hf_plan(moe)))
    assert (profile.tp_entries, profile.tp_exits) == (1 + profile.routed_rows,) * 2
    assert got[moe]["tp_sent"] - got[dense]["tp_sent"] == layer_bytes(moe) - layer_bytes(dense)


def test_plan_search_tries_every_ep_that_divides_dp_and_the_experts() -> None:
    """`ep = auto`: the divisors of dp·cp that divide the 4 experts; each layout's plan
    keeps its ep, and a plan that names its ep is searched at that ep alone."""
    base = with_model_shape(hf_plan(HFCase("mixtral", dp=4)))
    auto = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, ep="auto"))
    ranked = search_all(auto, top=200).ranked
    assert {est.layout.ep for _, est in ranked} == {1, 2, 4}
    assert all(plan.parallel.ep == est.layout.ep for plan, est in ranked)
    two = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, ep=2))
    assert {est.layout.ep for _, est in search_all(two, top=200).ranked} == {2}


def test_sequence_parallel_moe_is_left_unpriced_rather_than_priced_split() -> None:
    """Under sp a MoE block runs on the whole sequence (`shard_sequence._experts_whole`);
    the models would count it split: no figure, and plan search does not offer it."""
    case = HFCase("mixtral", tp=2, sp=True)
    decisions = compile_plan(hf_plan(case), model=hf_module(case)).decisions
    assert decisions.estimate is None
    assert "sequence parallelism with mixture-of-experts blocks is not priced" in \
        decisions.unpriced
    base = with_model_shape(hf_plan(HFCase("mixtral", tp=2)))
    assert not any(est.layout.sp for _, est in search_all(base, top=200).ranked)


def test_explain_says_what_each_all_to_all_carries() -> None:
    """`ptc explain` of an ep plan: the ep_comm row, and per all-to-all and per step the
    bytes `ep_rows_bytes` and `ep_bytes_per_step` price."""
    plan = with_model_shape(hf_plan(HFCase("mixtral", dp=4, ep=2)))
    buffer = io.StringIO()
    Console(file=buffer, width=1000).print(render_explain(plan))
    out = buffer.getvalue()
    profile, layout = plan_profile(plan), layout_of(plan)
    prec = plan_precision(plan, profile)
    rows = ep_rows_bytes(profile, prec, layout.micro_batch, plan.train.seq_len)
    step = ep_bytes_per_step(profile, layout, prec, plan.train.seq_len)
    assert "│ ep_comm" in out and "tp1 pp1 dp4 ep2" in out
    assert f"Experts: each rank holds 1/2 of every layer's routed experts; each all-to-all of " \
           f"a layer is handed {format_bytes(rows)} per micro-batch" in out
    assert f"{format_bytes(step)} a step on the busiest stage" in out
    assert "Priced at a routing imbalance of 1 (an even routing; ptc calibrate measures it)" in out
    skewed = dataclasses.replace(plan, moe=dataclasses.replace(plan.moe, imbalance=1.5))
    buffer = io.StringIO()
    Console(file=buffer, width=1000).print(render_explain(skewed))
    assert "Priced at a routing imbalance of 1.5 (the plan's moe.imbalance)" in buffer.getvalue()


def test_a_capacity_below_one_is_left_unpriced() -> None:
    """It drops rows even at an even routing; at 1 and above the even routing drops none,
    and the plan is priced as the dropless one."""
    def decisions(factor: float):
        case = HFCase("mixtral", dp=2, ep=2, capacity=factor)
        return compile_plan(hf_plan(case), model=hf_module(case)).decisions

    assert decisions(0.5).estimate is None
    assert "moe.capacity_factor = 0.5 is not priced" in decisions(0.5).unpriced
    dropless = compile_plan(hf_plan(HFCase("mixtral", dp=2, ep=2)),
                            model=hf_module(HFCase("mixtral", dp=2, ep=2))).decisions
    assert decisions(1.25).estimate.step_time_s == dropless.estimate.step_time_s
