"""`ptc.run(ptc.compile(module, plan))`: the module that was given is the module that trains.

A user's module (nanoGPT through the fx door; a Hugging Face-style Llama through the
export door, whose graph creates tensors with `device=meta` literals) is compiled
and run in this process and on two launched processes; either way the losses are
those of eager training of that very module, from its own weights, within the
derived bounds of `tests/tolerances.py`. A module the workers cannot receive is
refused before any process starts.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from dist_helpers import ROOT, reference
from torch import nn

import ptc
from ptc.errors import PlanError, PtcError
from ptc.plan import DataSpec, HardwareSpec, InitSpec, ModelSpec, OptimizerSpec, ParallelSpec, \
    Plan, TrainSpec
from tests.tolerances import assert_losses_match
from tests.user_models.hf_llama import hf_llama
from tests.user_models.nanogpt import nanogpt
from tests.user_models.transformers_models import llama as transformers_llama

pytestmark = pytest.mark.distributed

VOCAB, SEQ = 64, 16
SIZES = {
    "nanogpt": dict(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, block_size=SEQ, bias=True,
                    dropout=0.0),
    "hf_llama": dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ),
}
"""Each module's arguments: the plans name its factory with them, so the model ptc prices
is the module that trains (a plan pricing another model: tests/cost/test_custom_profile)."""
MODULES = {
    "nanogpt": ("tests.user_models.nanogpt:nanogpt", lambda: nanogpt(**SIZES["nanogpt"])),
    "hf_llama": ("tests.user_models.hf_llama:hf_llama", lambda: hf_llama(**SIZES["hf_llama"])),
}


@pytest.fixture(autouse=True)
def importable_tests(monkeypatch):
    # Spawned workers unpickle the module by its class's import path: tests.user_models.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("PTC_TIMEOUT", "60")


def plan_for(factory: str, dp: int) -> Plan:
    kwargs = next((SIZES[name] for name, (f, _) in MODULES.items() if f == factory), {})
    return Plan(model=ModelSpec(family="custom", factory=factory, kwargs=kwargs, vocab=VOCAB,
                                max_seq=SEQ),
                hardware=HardwareSpec.preset("cpu", gpus_per_node=dp),
                parallel=ParallelSpec(dp=dp, zero=1 if dp > 1 else 0),
                train=TrainSpec(seq_len=SEQ, global_batch=4, micro_batch=2, steps=3, dtype="fp32",
                                grad_clip=1.0, optimizer=OptimizerSpec(lr=3e-3),
                                data=DataSpec(kind="synthetic", seed=5)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("name", list(MODULES))
def test_run_of_a_compiled_module_trains_that_module(name, dp):
    factory, make = MODULES[name]
    torch.manual_seed(11)  # weights of the module's own init, not ptc's
    module = make()
    plan = plan_for(factory, dp)
    result = ptc.run(ptc.compile(module, plan))
    assert_losses_match(result.losses, reference(plan, module), f"{name} dp{dp}")


@pytest.mark.timeout(300)
def test_a_module_other_than_the_factorys_trains_unpriced_and_says_so_once(capfd, caplog):
    """A nanoGPT of 3 layers where the plan's factory builds 2: the compile says once that
    nothing is predicted and why (a warning); the two ranks, which compile it again, do not
    repeat it on their output, and the run's first line names the reason."""
    factory, _ = MODULES["nanogpt"]
    module = nanogpt(**{**SIZES["nanogpt"], "n_layer": 3})
    result = ptc.run(ptc.compile(module, plan_for(factory, 2)))
    assert len(result.losses) == 3
    [warning] = [r.getMessage() for r in caplog.records
                 if r.getMessage().startswith("no predicted step time")]
    assert warning.startswith("no predicted step time: the module compiled has ")
    printed = capfd.readouterr()
    said = (printed.out + printed.err).splitlines()
    assert not [line for line in said if line.startswith("no predicted step time")], said
    assert [line for line in said if line.startswith("ptc run: ")][0].endswith(warning)


def test_a_module_the_workers_cannot_receive_is_refused_before_launch():
    class Unsendable(nn.Module):  # defined in a function: pickle cannot name its class
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 32)
            self.head = nn.Linear(32, VOCAB)

        def forward(self, tokens, targets):
            logits = self.head(self.embed(tokens))
            return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    program = ptc.compile(Unsendable(), plan_for(MODULES["nanogpt"][0], 2))
    with pytest.raises(PtcError, match=r"ptc.run: the module given to ptc.compile "
                                       r"\(.*Unsendable\) cannot be sent to the 2 worker "
                                       r"processes: .*; define its class at module level"):
        ptc.run(program)


def test_a_module_whose_buffers_have_no_value_is_refused_before_launch():
    # Built on the meta device: its rotary table is a buffer no state dict holds and its
    # module cannot recompute, so every worker would fail on it; refused here instead.
    with torch.device("meta"):
        module = MODULES["hf_llama"][1]()
    program = ptc.compile(module, plan_for(MODULES["hf_llama"][0], 2))
    with pytest.raises(PtcError, match=r"^buffer model\S*rotary_emb\S* has no value: it is "
                                       r"on the meta device, not in the state dict, \w+ has "
                                       r"no reset_buffers\(\) and no transformers model around "
                                       r"it computes it from its config; build the module"):
        ptc.run(program)
    assert all(b.is_meta for b in module.buffers())  # the check changed nothing


def test_a_transformers_model_built_on_meta_trains_from_its_weights_file(tmp_path):
    # The way a large Hugging Face model is built without memory: every tensor on the meta
    # device, its rotary table too (not in any state dict). The workers take the weights from
    # the file and the table from the model's class rebuilt from its config.
    config = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    torch.manual_seed(3)
    real = transformers_llama(**config)
    torch.save(real.state_dict(), tmp_path / "weights.pt")
    with torch.device("meta"):
        module = transformers_llama(**config)
    plan = plan_for("tests.user_models.transformers_models:llama", 2)
    plan = dataclasses.replace(plan, train=dataclasses.replace(
        plan.train, init=InitSpec(kind="state_dict", path=str(tmp_path / "weights.pt"))))
    result = ptc.run(ptc.compile(module, plan))
    assert_losses_match(result.losses, reference(plan, real), "meta-built transformers llama")


def test_a_module_whose_copies_would_not_fit_the_host_is_refused_before_launch(monkeypatch):
    # Each worker unpickles the whole module: 2 ranks of a host hold two copies. Past what
    # the machine has available (made small here), refused before any process starts.
    module = MODULES["nanogpt"][1]()
    program = ptc.compile(module, plan_for(MODULES["nanogpt"][0], 2))
    monkeypatch.setattr("ptc.lower.preflight._host_available_bytes", lambda: 1000)
    with pytest.raises(PlanError, match=r"each of the 2 ranks of a host receives the module "
                                        r"given to ptc.compile, its weights whole on the CPU "
                                        r"\(.*\): .*, more than the 1000 B this machine has "
                                        r"available; save its weights"):
        ptc.run(program)


@pytest.mark.timeout(300)
def test_a_transformers_module_compiled_for_a_mesh_trains_that_module():
    """`ptc.compile(module, {"dp": 2})`: the plan from the mesh and the module (its
    defaults, three steps) trains the module given, from its own weights, as eager does."""
    from ptc.lower.mesh_plan import plan_for_mesh

    torch.manual_seed(13)
    module = transformers_llama()
    base = plan_for_mesh(module, {"dp": 2})
    base = dataclasses.replace(base, train=dataclasses.replace(
        base.train, steps=3, global_batch=4, optimizer=OptimizerSpec(lr=3e-3)))
    program = ptc.compile(module, {"dp": 2}, base=base)
    result = ptc.run(program)
    assert_losses_match(result.losses, reference(program.plan, module), "transformers llama dp2")
