"""Checkpoints of expert-parallel runs load under any ep, and export under the module's names.

A tiny Mixtral (2 layers of 4 routed experts, top-2) trains under ep 4 · dp 4
ZeRO-1 (each rank holds one expert of every stack) for 3 steps, records
every parameter, Adam moment and the step count, starts an async save and
trains 2 more steps while it is written. Then, on 4 processes, ep 2 · dp 4
ZeRO-2 (two experts a rank, their weights and optimizer state sharded over
the 2 ranks holding the same experts) and ep 1 · dp 4 ZeRO-1 (every expert
on every rank, sharded over dp as any weight) load it, train 2 steps and
save their own checkpoints; on 2 processes ep 2 · dp 2 ZeRO-0 loads the ep 4
checkpoint, ep 1 · dp 2 ZeRO-0 the ep 2 ZeRO-2 one, and ep 2 · dp 2 ZeRO-1
the ep 1 one (the experts split again).

Every load must give back bit-equal tensors (full: gathered over each
unit's shards, the ep ranks' experts and tp), the step and the data
position; the next 2 steps' losses must match those of the run that saved
(continuing uninterrupted) within the bounds `tests/tolerances.py` derives
from eager training in fp32 and fp64 (another layout sums in another
order) — which they could not if a sample were skipped or repeated.

Export: the ep 4 checkpoint written by the test's worker, exported with the
module (`ptc.export(..., hf=, model=)`), gives from_pretrained every stack at
its full [experts, ., .] shape, bit-equal to the weights saved; and an ep 4 ·
dp 4 ZeRO-1 run of the production loop (`ptc.run`, from `init = hf(dir)` of the
module's `save_pretrained`, per-expert tensors and all), exported by
`ptc export CHECKPOINT --hf OUT` (the module rebuilt from the manifest), gives
the eager-trained parameters within the same bounds.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from ckpt_helpers import GLOBAL_BATCH, assert_restored, load_worker, save_worker
from dist_helpers import reference
from hf_helpers import HFCase, hf_module, hf_plan
from transformers import AutoModelForCausalLM

import ptc
from ptc.cli import main
from ptc.plan import InitSpec, Plan, RuntimeSpec
from ptc.runtime.launcher import run_local
from tests.tolerances import assert_losses_match, assert_params_match

pytestmark = pytest.mark.distributed
MODEL = "mixtral"
SAVED_STEPS, MORE = 3, 2
EXPERTS = 4
MODULE = functools.partial(hf_module, HFCase(MODEL))
"""Builds the module every rank compiles (seeded: the same weights everywhere)."""


def plan(*, dp: int, ep: int, zero: int) -> Plan:
    """The tiny Mixtral on dp ranks with ep over them; global batch 8 (dp 1, 2, 4 divide it),
    the learning-rate schedule fixed over every step any run here reaches."""
    base = hf_plan(HFCase(MODEL, dp=dp, ep=ep, zero=zero))
    return dataclasses.replace(base, train=dataclasses.replace(
        base.train, global_batch=GLOBAL_BATCH, steps=SAVED_STEPS + 2 * MORE,
        lr_schedule=dataclasses.replace(base.train.lr_schedule, decay_steps=8)))


_eager_module: list[torch.nn.Module] = []


def eager():
    """The eager fp32/fp64 runs of every step (one module object: `reference` caches by it)."""
    if not _eager_module:
        _eager_module.append(MODULE())
    return reference(plan(dp=1, ep=1, zero=0), _eager_module[0])


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return {name: str(tmp_path_factory.mktemp(name)) for name in ("ep4", "ep2", "ep1")}


@pytest.fixture(scope="module")
def expected(dirs):
    """What each checkpoint holds, the losses of the steps after it (uninterrupted), and the
    4-process loads of the ep 4 one."""
    saved = run_local(save_worker, 4, plan(dp=4, ep=4, zero=1), dirs["ep4"], SAVED_STEPS, MORE,
                      MODULE)[0]
    ep2, ep1 = run_local(load_worker, 4, [(plan(dp=4, ep=2, zero=2), dirs["ep4"]),
                                          (plan(dp=4, ep=1, zero=1), dirs["ep4"])],
                         MORE, [dirs["ep2"], dirs["ep1"]], MODULE)[0]
    return {"ep4": (SAVED_STEPS, saved["state"], saved["after"], None),
            "ep2": (SAVED_STEPS + MORE, ep2["saved"], ep2["saved_after"], ep2),
            "ep1": (SAVED_STEPS + MORE, ep1["saved"], ep1["saved_after"], ep1)}


def check(got: dict, expected: tuple, what: str) -> None:
    step, state, after, _ = expected
    assert_restored(got, step, state, what)
    assert_losses_match(got["after"], eager(), f"{what}: losses of the next steps",
                        steps=range(step, step + MORE), against=after)


@pytest.mark.timeout(300)
def test_the_saved_state_holds_every_expert_at_full_shape(expected):
    state = expected["ep4"][1]
    stacks = [name for name in state if name.endswith(("gate_up_proj", "down_proj"))]
    assert len(stacks) == 2 * 3 * 2, stacks  # 2 layers x 2 stacks x (weight, 2 moments)
    assert all(state[name].shape[0] == EXPERTS for name in stacks)
    for layer in range(2):  # the experts differ: each ep rank's went to its own place
        stack = state[f"model.model.layers.{layer}.mlp.experts.down_proj"]
        assert all(not torch.equal(stack[0], stack[j]) for j in range(1, EXPERTS))


@pytest.mark.timeout(300)
def test_ep2_and_ep1_at_dp4_load_an_ep4_checkpoint(expected):
    check(expected["ep2"][3], expected["ep4"], "ep2·dp4 ZeRO-2 from ep4·dp4 ZeRO-1")
    check(expected["ep1"][3], expected["ep4"], "ep1·dp4 ZeRO-1 from ep4·dp4 ZeRO-1")


@pytest.mark.timeout(300)
def test_checkpoints_reshard_across_ep_at_dp2(expected, dirs):
    jobs = [("ep4", 2, 0), ("ep2", 1, 0), ("ep1", 2, 1)]
    results = run_local(load_worker, 2, [(plan(dp=2, ep=ep, zero=zero), dirs[source])
                                         for source, ep, zero in jobs], MORE, None, MODULE)[0]
    for (source, ep, zero), got in zip(jobs, results):
        check(got, expected[source], f"ep{ep}·dp2 ZeRO-{zero} from the {source} checkpoint")


@pytest.mark.timeout(300)
def test_export_of_an_ep_checkpoint_writes_every_expert_under_the_modules_names(
        expected, dirs, tmp_path):
    ptc.export(dirs["ep4"], hf=tmp_path / "out", model=MODULE())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    module = MODULE()
    params = dict(loaded.named_parameters())
    assert params.keys() == dict(module.named_parameters()).keys()
    state = expected["ep4"][1]
    for name, value in params.items():
        assert value.shape == module.get_parameter(name).shape, name
        assert torch.equal(value, state[f"model.{name}"]), f"{name} differs from the saved"


@pytest.mark.timeout(600)
def test_ptc_export_hf_of_an_ep_run(tmp_path, capsys):
    # The weights the eager run starts from, as transformers saves them: its per-expert
    # w1/w2/w3 tensors, stacked again on reading (`ptc.runtime.hf_conversion`).
    MODULE().save_pretrained(tmp_path / "in")
    base = plan(dp=4, ep=4, zero=1)
    run = dataclasses.replace(
        base, train=dataclasses.replace(base.train, init=InitSpec(kind="hf", path=str(
            tmp_path / "in"))),
        runtime=RuntimeSpec(checkpoint_dir=str(tmp_path / "ckpt"), async_save=False))
    result = ptc.run(run)
    assert_losses_match(result.losses, eager(), "ep4·dp4 ZeRO-1 (ptc.run)")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'out'}: the weights of step " \
        f"{run.train.steps} ({tmp_path / 'ckpt'})"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    params = dict(loaded.named_parameters())
    for name in ("gate_up_proj", "down_proj"):
        for layer in range(2):
            full = f"model.layers.{layer}.mlp.experts.{name}"
            assert params[full].shape == MODULE().get_parameter(full).shape
    assert_params_match(params, eager(), "ep4·dp4 ZeRO-1 exported")
