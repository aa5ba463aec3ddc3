"""Hugging Face weights in and out: save_pretrained -> ptc training -> ptc export -> from_pretrained.

A tiny Llama (untied head) trains under tp2 x pp2 and a tiny GPT-2 (tied head,
Conv1D weights stored [in, out], 63 tokens: a vocabulary padded to 64 rows
under tp) under tp2 x dp2, each on 4 gloo processes
through `ptc.run`, starting from `init = hf(dir)` of its own seeded weights
and writing a checkpoint at the end. Then, in this process:

- the losses of every step equal eager training of the same module from the
  same weights (bounds derived in tests/tolerances.py), so the weights came in;
- `ptc export CHECKPOINT --hf OUT` gives a directory whose `from_pretrained`
  model has the eager-trained parameters (same bounds), tied head included;
- `ptc export CHECKPOINT --torch FILE` gives a state dict that
  `load_state_dict(strict=True)` takes, and a module loaded from it computes
  the very logits of the from_pretrained one.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from dist_helpers import reference
from hf_helpers import HFCase, hf_module, hf_plan
from transformers import AutoModelForCausalLM

import ptc
from ptc.cli import main
from ptc.plan import InitSpec, RuntimeSpec
from tests.tolerances import assert_losses_match, assert_params_match

pytestmark = pytest.mark.distributed

CASES = [HFCase("llama", tp=2, pp=2), HFCase("gpt2", tp=2, dp=2, config=(("vocab_size", 63),))]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_weights_round_trip_through_training_under_tp_and_pp(case: HFCase, tmp_path,
                                                             capsys) -> None:
    module = hf_module(case)
    module.save_pretrained(tmp_path / "in")
    base = hf_plan(case)
    plan = dataclasses.replace(
        base, train=dataclasses.replace(base.train, init=InitSpec(kind="hf", path=str(
            tmp_path / "in"))),
        runtime=RuntimeSpec(checkpoint_dir=str(tmp_path / "ckpt"), async_save=False))
    result = ptc.run(plan)
    ref = reference(base, module)
    assert_losses_match(result.losses, ref, str(case))

    capsys.readouterr()
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "out")]) == 0
    # The checkpoint folder's latest step is the last one trained: the export says which.
    assert capsys.readouterr().out.strip() == \
        f"wrote {tmp_path / 'out'}: the weights of step {plan.train.steps} ({tmp_path / 'ckpt'})"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert_params_match(dict(loaded.named_parameters()), ref, f"{case} exported")

    assert main(["export", str(tmp_path / "ckpt"), "--torch", str(tmp_path / "w.pt")]) == 0
    fresh = hf_module(case)
    fresh.load_state_dict(torch.load(tmp_path / "w.pt", weights_only=True), strict=True)
    tokens = torch.randint(0, 63, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(fresh(tokens).logits, loaded(tokens).logits)


@pytest.mark.timeout(600)
def test_the_example_trains_a_saved_llama_under_tp_pp_dp_and_exports_it(tmp_path,
                                                                        monkeypatch) -> None:
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)  # the plan's factory is examples.hf_llama:tiny_llama
    from examples.hf_llama import main as example

    example(["save", str(tmp_path / "in")])
    base = ptc.load_plan(root / "examples" / "hf_llama_tp2_pp2_dp2.ptc")
    assert base.train.init == InitSpec(  # the plan's relative path, from the plan's folder
        kind="hf", path=str(root / "examples" / "weights" / "tiny-llama"))
    plan = dataclasses.replace(
        base, train=dataclasses.replace(base.train, steps=2, init=InitSpec(
            kind="hf", path=str(tmp_path / "in"))),
        runtime=dataclasses.replace(base.runtime, checkpoint_dir=str(tmp_path / "ckpt")))
    result = ptc.run(plan)
    assert len(result.losses) == 2 and all(math.isfinite(x) for x in result.losses)
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "out")]) == 0
    before = AutoModelForCausalLM.from_pretrained(tmp_path / "in")
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    moved = [name for name, p in after.named_parameters()
             if not torch.equal(p, before.get_parameter(name))]
    assert len(moved) == len(list(after.parameters()))  # every weight trained, none lost
