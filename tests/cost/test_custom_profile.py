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
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
for extra in (ROOT, ROOT / "tests" / "distributed"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import ptc  # noqa: E402
from hf_helpers import HFCase, hf_plan  # noqa: E402
from ptc.compiler.profile import with_model_shape  # noqa: E402
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
    from ptc.compiler import profile
    from ptc.errors import PtcError

    (tmp_path / "scratch_model.py").write_text("import torch\n"
                                               "def build():\n"
                                               "    return torch.nn.Linear(2, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PTC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(profile, "_CACHE", {})
    calls = []

    def refuse(spec, dtype):
        calls.append(spec.factory)
        raise PtcError(f"model \"{spec.factory}\": no token embedding found")

    monkeypatch.setattr(profile, "_profile_one_layer", refuse)
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
