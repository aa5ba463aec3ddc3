"""Predictions for a model ptc did not write: the profile read off its own captured graph.

A Hugging Face Llama is profiled from its graph (layers, widths, heads, the
split tensor parallelism would make, the attention core), with the same
node predicates the tensor_parallel pass uses; its estimate must then equal
that of ptc's built-in Llama of the same shape (the same computation, written
by other hands) within 2 %, term by term. A model whose activations do not
fit the profile's polynomial form is refused in one line, not mispredicted.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
for extra in (ROOT, ROOT / "tests" / "distributed"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import ptc  # noqa: E402
from hf_helpers import HFCase, hf_module, hf_plan  # noqa: E402
from ptc.compiler.profile.cache import with_model_shape  # noqa: E402
from ptc.plan import ModelSpec  # noqa: E402

pytestmark = pytest.mark.timeout(300)

BUILTIN = ModelSpec(family="llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64,
                    max_seq=16)


def test_the_shape_is_read_off_the_graph():
    model = with_model_shape(hf_plan(HFCase("llama", tp=2))).model
    assert (model.layers, model.hidden, model.heads, model.kv_heads, model.ffn, model.vocab) == (
        2, 32, 4, 2, 64, 64)


@pytest.mark.parametrize("case", [HFCase("llama", tp=2), HFCase("llama", dp=2, zero=3),
                                  HFCase("llama", pp=2)], ids=str)
def test_a_transformers_llama_is_predicted_as_the_builtin_llama(case):
    plan = hf_plan(case)
    # The kernels' work compared: transformers also dispatches more (smaller) ops.
    plan = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware,
                                                                  dispatch_overhead=0.0))
    theirs = ptc.estimate(plan)
    ours = ptc.estimate(dataclasses.replace(plan, model=BUILTIN))
    assert theirs.step_time_s == pytest.approx(ours.step_time_s, rel=0.05)
    for stage, (a, b) in enumerate(zip(theirs.stage_memory_bytes, ours.stage_memory_bytes)):
        assert a == pytest.approx(b, rel=0.02), f"stage {stage}"


def test_checkpoint_auto_works_for_a_transformers_model():
    plan = hf_plan(HFCase("llama", tp=2))
    plan = dataclasses.replace(plan, parallel=dataclasses.replace(plan.parallel,
                                                                  checkpoint="auto"))
    program = ptc.compile(None, plan)
    assert program.decisions.estimate is not None
    assert set(program.decisions.checkpoint) <= {"none", "selective", "full"}


def test_a_model_that_cannot_be_profiled_is_profiled_once_until_its_source_changes(
        tmp_path, monkeypatch):
    # Profiling captures a model a dozen times: the reason it failed is kept like a profile
    # (every rank and every estimate would otherwise pay it again), and its factory's source
    # is part of the key, so a fixed model is profiled afresh.
    from ptc.compiler.profile import cache as profile
    from ptc.errors import PtcError

    (tmp_path / "scratch_model.py").write_text("import torch\n"
                                               "def build():\n"
                                               "    return torch.nn.Linear(2, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PTC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(profile, "_CACHE", {})
    calls = []

    def refuse(spec, dtype, shards, fp8_recipe):
        calls.append(spec.factory)
        raise PtcError(f"model \"{spec.factory}\": no token embedding found")

    monkeypatch.setattr(profile, "profile_one_layer", refuse)
    spec = ModelSpec(family="custom", factory="scratch_model:build")
    for _ in range(2):
        with pytest.raises(PtcError, match="no token embedding found"):
            profile.model_profile(spec, "fp32")
    monkeypatch.setattr(profile, "_CACHE", {})  # another process: the one on disk
    with pytest.raises(PtcError, match="no token embedding found"):
        profile.model_profile(spec, "fp32")
    assert calls == ["scratch_model:build"]
    (tmp_path / "scratch_model.py").write_text("import torch\n"
                                               "def build():\n"
                                               "    return torch.nn.Linear(2, 3)\n")
    monkeypatch.setattr(profile, "_CACHE", {})
    with pytest.raises(PtcError):
        profile.model_profile(spec, "fp32")
    assert len(calls) == 2


def test_processes_that_start_together_profile_a_model_once(tmp_path):
    # The ranks of a host start together and would each profile the same model: the first
    # profiles under a lock, the others wait for it and read its file. The factory is slow
    # (3 s) so that both processes reach the cache while the first is still profiling.
    (tmp_path / "counted_model.py").write_text(
        "import os, time\n"
        "from tests.user_models.nanogpt import nanogpt\n"
        "def build():\n"
        "    with open(os.environ['PTC_TEST_CALLS'], 'a') as f:\n"
        "        f.write(f'{os.getpid()}\\n')\n"
        "    time.sleep(3)\n"
        "    return nanogpt(n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=16)\n")
    calls = tmp_path / "calls"
    env = dict(os.environ, PTC_CACHE_DIR=str(tmp_path / "cache"), PTC_TEST_CALLS=str(calls),
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    script = ("from ptc.compiler.profile.cache import model_profile\n"
              "from ptc.plan import ModelSpec\n"
              "spec = ModelSpec(family='custom', factory='counted_model:build', max_seq=16)\n"
              "print(model_profile(spec, 'fp32').shape.hidden)\n")
    ranks = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [rank.communicate(timeout=240) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    assert [out.strip() for out, _ in outputs] == ["16", "16"]
    assert len(set(calls.read_text().split())) == 1, "one process profiled, the other read it"


@pytest.mark.parametrize("factory, kwargs", [
    ("deepseek_v3", {}),  # a dense first layer, then experts
    ("qwen3_moe", {"mlp_only_layers": [1]}),  # experts, then a dense layer
    ("lfm2", {}),  # a convolution layer, then an attention one
])
def test_a_model_whose_layers_read_unlike_parameters_is_not_priced(factory, kwargs):
    """The memory and cost models price every layer as the first: a model whose layers hold
    different parameters gets no prediction (never the first layer's times the count)."""
    from ptc.compiler.profile import cache as profile  # noqa: PLC0415
    from ptc.errors import PtcError  # noqa: PLC0415

    spec = ModelSpec(family="custom", kwargs=kwargs,
                     factory=f"tests.user_models.transformers_models:{factory}")
    with pytest.raises(PtcError, match=r"its layers are not alike \(layer 0 reads [\d,]+ "
                                       r"parameter elements, layer 1 [\d,]+\)"):
        profile.model_profile(spec, "fp32")


def test_a_compiled_module_is_priced_only_when_it_is_the_model_the_plan_prices():
    """`ptc.compile(module, plan)` prices the model the plan's factory builds: a module with
    other parameters or layers gets no predictions (and no checkpoint = auto policies made
    for another model), in one line saying both counts."""
    case = HFCase("llama", dp=2)
    plan = hf_plan(case)
    assert ptc.compile(hf_module(case), plan).decisions.estimate is not None
    deeper = HFCase("llama", dp=2, config=(("num_hidden_layers", 3),))
    decisions = ptc.compile(hf_module(deeper), plan).decisions
    assert decisions.estimate is None
    given, priced = (sum(p.numel() for p in hf_module(c).parameters()) for c in (deeper, case))
    assert decisions.unpriced == (
        f"no predicted step time: the module compiled has {given:,} parameter elements in 3 "
        f"layers, and the model the plan's factory \"{plan.model.factory}\" builds (the one "
        f"ptc prices) has {priced:,} in 2: predictions of that model would not be this one's; "
        "name a factory that builds this module")
    auto = dataclasses.replace(plan, parallel=dataclasses.replace(plan.parallel,
                                                                  checkpoint="auto"))
    with pytest.raises(ptc.CompileError, match="checkpoint = auto needs the cost model"):
        ptc.compile(hf_module(deeper), auto)


def test_a_custom_model_that_does_not_fit_is_refused_before_any_process_starts():
    """Compiled from a module the plan prices, or built from the plan's factory: `ptc.run`
    refuses a plan predicted over its memory budget in one line per stage, with the
    micro-batch or model parallelism that would fit read off the custom model's shape."""
    case = HFCase("llama", dp=2)
    plan = hf_plan(case)
    small = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware,
                                                                   hbm_bytes=100_000))
    program = ptc.compile(hf_module(case), small)
    assert not program.decisions.estimate.fits
    for what in (program, small):
        with pytest.raises(ptc.PlanError, match=r"stage 0 needs .* over the .* budget"):
            ptc.run(what)
