"""Worker of test_recompute_equivalence: train tiny plans with activation checkpointing.

Every case runs on 2 processes (dp 2, tp 2 or pp 2), so one launch trains
them all in a row and process start-up is paid once.
"""

from __future__ import annotations

import dataclasses

from dist_helpers import tiny_plan, train_cases
from pp_helpers import Case, pp_plan
from tp_helpers import TPCase, tp_plan

from ptc.plan import Plan

LAYOUTS = ("dp2", "tp2", "pp2")
"""The 2-process layouts: dp 2 (ZeRO `zero`), tp 2, pp 2 with 1F1B over 2 micro-batches."""


@dataclasses.dataclass(frozen=True)
class RecomputeCase:
    """One 2-process layout of one tiny model under one checkpoint policy."""

    family: str
    """"gpt" or "llama"."""
    layout: str
    """One of LAYOUTS."""
    checkpoint: str | tuple[str, ...]
    """"none", "selective", "full", "ops", "modules(...)", "auto" or one policy per layer."""
    zero: int = 0
    """ZeRO stage (dp2 only)."""

    def __str__(self) -> str:
        ckpt = self.checkpoint if isinstance(self.checkpoint, str) else ",".join(self.checkpoint)
        zero = f" zero{self.zero}" if self.layout == "dp2" else ""
        return f"{self.family} {self.layout}{zero} checkpoint={ckpt}"


def base_plan(case: RecomputeCase) -> Plan:
    """The case's plan before its checkpoint policy is set (the helpers' tiny plans)."""
    if case.layout == "dp2":
        return tiny_plan(case.family, zero=case.zero, dp=2, accum=1)
    if case.layout == "tp2":
        return tp_plan(TPCase(case.family, 2))
    return pp_plan(Case(case.family, 2, "1f1b", 2))


def recompute_plan(case: RecomputeCase) -> Plan:
    """The case's plan with its checkpoint policy; "auto" gets the budget of `auto_budget`."""
    plan = base_plan(case)
    plan = dataclasses.replace(plan, parallel=dataclasses.replace(
        plan.parallel, checkpoint=case.checkpoint))
    if case.checkpoint != "auto":
        return plan
    hw = plan.hardware
    return dataclasses.replace(plan, hardware=dataclasses.replace(
        hw, memory_margin=hw.hbm_bytes - auto_budget(plan)))


def auto_budget(plan: Plan) -> float:
    """Stage 0's peak bytes (memory model) with its first layer fully recomputed, the rest not.

    Under this budget the last stage of a pipeline (one micro-batch in flight,
    not two) fits without recompute while stage 0 must recompute: "auto"
    resolves to a mix that differs between layers and between stages.
    """
    from ptc.compiler.search.estimate import estimate
    from ptc.compiler.records.layout import layout_of

    policy = ["none"] * plan.model.layers
    policy[layout_of(plan, "none").stage_layers(0)[0]] = "full"
    forced = dataclasses.replace(plan, parallel=dataclasses.replace(
        plan.parallel, checkpoint=tuple(policy)))
    return estimate(forced).stage_memory_bytes[0]


def program_policies(program) -> tuple[str, ...]:
    """Per layer, the policy the compiled graphs apply, read off their checkpoint regions."""
    from ptc.passes.checkpoint_layers import region_layer_policy
    from ptc.ops.recompute import checkpoint_region

    policies = ["none"] * program.plan.model.layers
    for stage in program.stages:
        for node in stage.graph.graph.nodes:
            if node.op == "call_function" and node.target is checkpoint_region:
                layer, policy = region_layer_policy(node.args[0].target)
                policies[layer] = policy
    return tuple(policies)


def run_recompute_cases(cases: list[RecomputeCase]) -> dict:
    """Worker: train every case (`train_cases`); rank 0's results also hold "policies",
    every rank's per-layer policies."""
    results = train_cases(cases, recompute_plan,
                          gathered=lambda trainer, program, groups: program_policies(program))
    for got in results.values():
        got["policies"] = got.pop("gathered")
    return results
