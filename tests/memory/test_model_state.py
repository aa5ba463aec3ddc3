"""Model-state bytes: the ZeRO formulas as identities, and exact counts against torch."""

from __future__ import annotations

import dataclasses

import pytest
import sympy
import torch
from torch.nn import functional as F

from ptc.compiler.records.layout import Layout
from ptc.compiler.memory.model import d, precision, stage_memory, stage_memory_expr, t
from ptc.compiler.profile.cache import model_profile
from ptc.models import build_model
from ptc.plan import ModelSpec
from ptc.worker import MODELS

GPT = ModelSpec(family="gpt", layers=2, hidden=64, heads=4, vocab=128, max_seq=32)
LLAMA = ModelSpec(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=160,
                  vocab=128, max_seq=32)


def _layout(layers: int, **changes) -> Layout:
    base = Layout(tp=1, pp=1, dp=1, vstages=1, micro_batch=2, microbatches=1, zero=0, sp=False,
                  schedule="1f1b", layers=layers, checkpoint="none", overlap=True)
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize("zero, per_param", [(0, 18), (1, 6 + 12 / d), (2, 2 + 16 / d),
                                             (3, 16 / d)])
def test_zero_bytes_per_parameter(zero, per_param):
    """bf16 weights, fp32 main gradients, fp32 master and Adam moments: Megatron-LM's
    "bf16 param, fp32 grads" row (18 bytes; 6 + 12/d with its distributed optimizer, which
    is ZeRO-1), ZeRO-2 also sharding the gradients; ZeRO-3 shards everything and keeps no
    bf16 copy beside the fp32 master shard (FSDP2's 16/d)."""
    profile = model_profile(GPT, "bf16")
    layout = _layout(GPT.layers, dp=8, zero=zero)
    terms = stage_memory_expr(profile, layout, precision(2, "adamw"), 0)
    n = profile.params["layer"].total * GPT.layers + profile.params["pre"].total \
        + profile.params["post"].total
    state = (terms["weights"] + terms["grads"] + terms["optimizer"]).subs(t, 1)
    counters = 4 * (profile.params["layer"].tensors * GPT.layers + profile.params["pre"].tensors
                    + profile.params["post"].tensors) / (d if zero else 1)
    assert sympy.simplify(state - per_param * n - counters) == 0


@pytest.mark.parametrize("spec", [GPT, LLAMA], ids=["gpt", "llama"])
def test_fp32_adam_state_is_exact(spec):
    torch.manual_seed(0)
    model = build_model(spec, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, spec.vocab, (2, 16))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    opt.step()
    params = list(model.parameters())
    measured = {
        "weights": sum(p.numel() * p.element_size() for p in params),
        "grads": sum(p.grad.numel() * p.grad.element_size() for p in params),
        "optimizer": sum(v.numel() * v.element_size() for st in opt.state.values()
                         for v in st.values()),
    }
    terms = stage_memory(model_profile(spec, "fp32"), _layout(spec.layers),
                         precision(4, "adamw"), 16)[0]
    assert {k: terms[k] for k in measured} == measured


def test_tied_head_is_a_second_copy_on_the_last_stage():
    profile = model_profile(GPT, "bf16")
    prec = precision(2, "adamw")
    one = stage_memory(profile, _layout(GPT.layers), prec, 16)[0]["weights"]
    two = stage_memory(profile, _layout(GPT.layers, pp=2, microbatches=2), prec, 16)
    assert sum(st["weights"] for st in two) == one + 2 * profile.tied_elements


def test_tensor_parallel_keeps_norms_whole():
    profile = model_profile(GPT, "bf16")
    layer = profile.params["layer"]
    # Two LayerNorms (weight + bias) and the two row-parallel biases stay whole.
    assert layer.replicated == 4 * GPT.hidden + 2 * GPT.hidden


RULES = {"inferred": (), "mlp whole": (("layers.*.mlp.*", "replicate"),),
         "attention whole": (("layers.*.attn.*", "replicate"),),
         "head whole": (("head", "replicate"),)}
"""Shard rules over the tiny Llama's modules: none, a block kept whole, the vocabulary head
kept whole."""


@pytest.mark.parametrize("rules", RULES.values(), ids=RULES.keys())
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_rank_weights_equal_the_lowered_graph(tp, rules):
    """Per tp rank, the predicted weights are the lowered graph's parameters: with 2
    key/value heads, split at tp 2 and replicated whole on every rank at tp 4; a linear a
    `shard ... replicate` rule keeps whole is whole in both."""
    from ptc.compiler.search.estimate import estimate  # noqa: PLC0415 - the whole compiler
    from ptc.lower.driver import compile_plan  # noqa: PLC0415
    from ptc.plan import (HardwareSpec, ParallelSpec, Plan, ShardRule,  # noqa: PLC0415
                          TrainSpec)

    spec = dataclasses.replace(LLAMA, heads=8)
    shards = tuple(ShardRule(pattern=p, style=s) for p, s in rules)
    plan = Plan(model=spec, hardware=HardwareSpec.preset("cpu", gpus_per_node=tp),
                parallel=ParallelSpec(tp=tp, shards=shards),
                train=TrainSpec(seq_len=16, global_batch=2, micro_batch=2, dtype="fp32"))
    program = compile_plan(plan)
    held = 4 * program.layout.numel  # fp32, one stage
    assert estimate(plan).memory_terms[0]["weights"] == held


def _tiny_plan_in(dtype: str, zero: int):
    """The distributed tests' tiny Llama, one step at dp 1, in `dtype`: fp16 at the CPU's
    fp32 rate (its preset names none; memory does not depend on it), fp8 emulated."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
    from dist_helpers import tiny_plan

    plan = tiny_plan("llama", zero=zero, dp=1, accum=1, steps=1)
    peaks = {**plan.hardware.peak_flops, "fp16": plan.hardware.peak_flops["fp32"]}
    return dataclasses.replace(
        plan, hardware=dataclasses.replace(plan.hardware, peak_flops=peaks),
        train=dataclasses.replace(plan.train, dtype=dtype, fp8_emulate=dtype == "fp8"))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16", "fp8"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_predicted_model_state_equals_what_the_runtime_holds(dtype, zero):
    """The estimate's weights, gradients and optimizer state are the bytes a trained rank holds
    (`Trainer.held_bytes`, each storage once), in every dtype: 16-bit weights (fp8 keeps
    bf16 weights) with fp32 main gradients, fp32 masters and moments. Adam's step counters
    are left out on both sides (the model charges 4 bytes per tensor, the runtime keeps one
    0-dim counter per flat unit). At ZeRO-3 the graph's parameter is the fp32 master shard
    itself, so only the total compares."""
    from ptc.compiler.search.estimate import estimate
    from ptc.lower.driver import compile_plan
    from ptc.runtime.executor import Trainer

    plan = _tiny_plan_in(dtype, zero)
    trainer = Trainer(compile_plan(plan), {}, models=MODELS)
    trainer.train_step(0)
    held = trainer.held_bytes()
    assert held.pop("host") == 0  # nothing offloaded
    terms = estimate(plan).memory_terms[0]
    profile = model_profile(plan.model, dtype)
    counters = 4 * sum(profile.params[part].tensors * (plan.model.layers if part == "layer" else 1)
                       for part in ("pre", "layer", "post"))
    predicted = {"params": terms["weights"], "grads": terms["grads"],
                 "optimizer": terms["optimizer"] - counters}
    if zero == 3:
        assert sum(predicted.values()) == sum(held.values())
    else:
        assert predicted == held


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_offload_moves_master_and_state_bytes_to_the_host(dtype, zero):
    """`parallel.offload = optimizer`: the predicted device peak drops by exactly the
    optimizer term (Adam's moments and counters, with the fp32 master where it is a copy of
    its own: bf16 at ZeRO 1-2); every other term stays. The host then holds those bytes plus
    an fp32 master where the device's weights are the master (fp32, ZeRO-3) and the fp32
    gradient the CPU step reads: 16 bytes per element and the counters, whatever the dtype.
    The runtime holds exactly that (counters left out on both sides, as above)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
    from dist_helpers import tiny_plan

    from ptc.compiler.search.estimate import estimate
    from ptc.lower.driver import compile_plan
    from ptc.runtime.executor import Trainer

    plain = tiny_plan("llama", zero=zero, dp=1, accum=1, dtype=dtype, steps=1)
    plan = dataclasses.replace(plain, parallel=dataclasses.replace(plain.parallel,
                                                                   offload="optimizer"))
    before, after = estimate(plain), estimate(plan)
    kept, moved = before.memory_terms[0], after.memory_terms[0]
    assert moved["optimizer"] == 0 and before.host_memory_bytes == 0
    assert {k: v for k, v in moved.items() if k != "optimizer"} == \
        {k: v for k, v in kept.items() if k != "optimizer"}
    assert before.peak_memory_bytes - after.peak_memory_bytes == kept["optimizer"]
    profile = model_profile(plan.model, dtype)
    parts = ("pre", "layer", "post")
    n = sum(profile.params[p].total * (plan.model.layers if p == "layer" else 1) for p in parts)
    counters = 4 * sum(profile.params[p].tensors * (plan.model.layers if p == "layer" else 1)
                       for p in parts)
    own_master = 4 * n if dtype == "fp32" or zero == 3 else 0
    assert after.host_memory_bytes == kept["optimizer"] + own_master + 4 * n
    assert after.host_memory_bytes == 16 * n + counters

    trainer = Trainer(compile_plan(plan), {}, models=MODELS)
    trainer.train_step(0)
    held = trainer.held_bytes()
    assert held["host"] == after.host_memory_bytes - counters
    assert held["optimizer"] == 0
    device = {"params": moved["weights"], "grads": moved["grads"]}
    if zero == 3:
        assert sum(device.values()) == held["params"] + held["grads"]
    else:
        assert device == {"params": held["params"], "grads": held["grads"]}
