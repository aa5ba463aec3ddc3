"""Initial weights are the same full tensors whatever the layout: seeded, or from a state dict."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import tiny_plan

from ptc.compiler.records.params import ParamLayout
from ptc.errors import PtcError
from ptc.lower.driver import compile_plan
from ptc.models import build_model, initial_value
from ptc.plan import InitSpec, Plan
from ptc.runtime.init import initial_buffers, initial_params, reference_model

pytestmark = pytest.mark.timeout(60)


def _initial_params(plan: Plan, layout: ParamLayout):
    """The plan's initial weights as a rank makes them, from the built-in models."""
    return initial_params(plan, layout, reference_model(plan, build_model), initial_value)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_random_init_equals_the_eager_model_built_from_the_seed(family):
    plan = tiny_plan(family, zero=3, dp=2, accum=1)
    program = compile_plan(plan)
    values = _initial_params(plan, program.layout)
    model = build_model(plan.model, device="cpu", seed=plan.train.init.seed)
    expected = dict(model.named_parameters())
    assert set(values) == set(expected)
    for name, value in values.items():
        torch.testing.assert_close(value, expected[name].detach(), rtol=0, atol=0)


def test_rope_buffers_are_recomputed(tmp_path):
    plan = tiny_plan("llama", zero=0, dp=1, accum=1)
    program = compile_plan(plan)
    buffers = initial_buffers(program.stages[0].graph, plan, reference_model(plan, build_model))
    model = build_model(plan.model, device="cpu", seed=0)
    assert buffers and all(not b.is_meta for b in buffers.values())
    torch.testing.assert_close(buffers["layers.0.attn.rope.cos"], model.layers[0].attn.rope.cos)


def test_state_dict_init_accepts_any_name_of_a_tied_weight(tmp_path):
    plan = tiny_plan("gpt", zero=0, dp=1, accum=1)
    model = build_model(plan.model, device="cpu", seed=11)
    state = model.state_dict()
    state.pop("embed.weight")  # keep only the tied alias head.weight
    torch.save(state, tmp_path / "w.pt")
    plan = tiny_plan("gpt", zero=0, dp=1, accum=1,
                     init=InitSpec(kind="state_dict", path=str(tmp_path / "w.pt")))
    values = _initial_params(plan, compile_plan(plan).layout)
    torch.testing.assert_close(values["embed.weight"], model.embed.weight.detach())


def test_state_dict_errors_name_the_parameter(tmp_path):
    plan = tiny_plan("llama", zero=0, dp=1, accum=1)
    state = build_model(plan.model, device="cpu", seed=0).state_dict()
    layout = compile_plan(plan).layout
    broken = dict(state)
    broken.pop("layers.1.mlp.up.weight")
    torch.save(broken, tmp_path / "missing.pt")
    bad = tiny_plan("llama", zero=0, dp=1, accum=1,
                    init=InitSpec(kind="state_dict", path=str(tmp_path / "missing.pt")))
    with pytest.raises(PtcError, match=r"missing parameters \['layers.1.mlp.up.weight'\]"):
        _initial_params(bad, layout)
    broken = dict(state)
    broken["norm.weight"] = torch.ones(3)
    torch.save(broken, tmp_path / "shape.pt")
    bad = tiny_plan("llama", zero=0, dp=1, accum=1,
                    init=InitSpec(kind="state_dict", path=str(tmp_path / "shape.pt")))
    with pytest.raises(PtcError, match=r"norm.weight has shape \(3,\), the model needs \(32,\)"):
        _initial_params(bad, layout)
