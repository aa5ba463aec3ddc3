"""dump_plan: canonical text that parses back to an equal Plan."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from dsl_helpers import BASE, EXAMPLES
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from ptc.dsl import dump_plan, load_plan, parse
from ptc.dsl.dump import quantity
from ptc.errors import PlanError, PtcError
from ptc.plan import (
    AXES,
    LAYER_CHECKPOINT_POLICIES,
    DataSpec,
    HardwareSpec,
    InitSpec,
    LinkSpec,
    LRScheduleSpec,
    ModelSpec,
    OptimizerSpec,
    ParallelSpec,
    Plan,
    RuntimeSpec,
    ShardRule,
    TrainSpec,
)
from ptc.presets import PRESETS


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_round_trip(path: Path) -> None:
    plan = load_plan(path)
    text = dump_plan(plan)
    again = parse(text)
    assert again == plan
    assert dump_plan(again) == text  # canonical: a fixed point


def test_dump_is_readable() -> None:
    text = dump_plan(parse(BASE))
    assert text.startswith("model llama {\n  layers = 8\n")
    assert '  gpu = "H100-SXM"\n  nodes = 1\n  gpus_per_node = 8\n}' in text
    assert "  optimizer = adamw(lr = 0.0003, betas = (0.9, 0.95), eps = 1e-08, " \
           "weight_decay = 0.1)" in text
    assert "runtime {\n  checkpoint_dir = \"ckpt\"\n  nan_policy = rollback\n}" in text


@pytest.mark.parametrize("value, dimension, text", [
    (80 * 2**30, "bytes", "80 GiB"), (141e9, "bytes", "141 GB"), (450e9, "bandwidth", "450 GB/s"),
    (50e9, "bandwidth", "50 GB/s"), (989e12, "flops", "989 TFLOP/s"), (2e-6, "time", "2 us"),
    (1800.0, "time", "30 min"), (0.1234567, "time", "123.4567 ms"),
    (7200.0, "time", "2 h"), (1.0, "bytes", "1 B"), (1e-3, "bytes", "0.001 B"),
])
def test_quantity_picks_the_shortest_exact_unit(value: float, dimension: str, text: str) -> None:
    assert quantity(value, dimension) == text


def test_unwritable_values_raise_ptc_error() -> None:
    plan = Plan(model=ModelSpec(family="custom", factory="m:f", kwargs={"table": {"a": 1}}),
                hardware=HardwareSpec.preset("cpu", gpus_per_node=1),
                train=TrainSpec(seq_len=8, global_batch=1))
    with pytest.raises(PtcError, match="cannot write dict"):
        dump_plan(plan)


# ------------------------------------------------------- generated plans

_DEEP = int(os.environ.get("PTC_FUZZ_EXAMPLES", "0"))
ROUND_TRIP = settings(max_examples=_DEEP or 50, deadline=None, derandomize=not _DEEP,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

positive = st.floats(min_value=1e-9, max_value=1e15, allow_nan=False, allow_infinity=False)
fraction = st.floats(min_value=0.0, max_value=0.999, allow_nan=False)
text = st.text(min_size=1, max_size=12)  # paths and globs with quotes, escapes, unicode
python_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**62), 2**62) | text
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(tuple),
    max_leaves=6)


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    """Valid plans across the language: built-in and custom models, presets and custom
    hardware, every schedule and checkpoint form, every call form."""
    heads = draw(st.sampled_from([1, 2, 4, 8, 16]))
    tp = draw(st.sampled_from([d for d in (1, 2, 4, 8) if heads % d == 0]))
    pp = draw(st.sampled_from([1, 2, 4]))
    dp = draw(st.sampled_from([1, 2, 3]))
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zero_bubble", "zbv"]))
    v = {"interleaved": draw(st.integers(2, 3)), "zero_bubble": draw(st.integers(1, 3)),
         "zbv": 2}.get(schedule, 1)
    layers = pp * v * draw(st.integers(1, 4))
    if draw(st.booleans()):
        model = ModelSpec(family="custom", factory=draw(st.sampled_from(["a.b:c", "m:f"])),
                          kwargs=draw(st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,6}",
                                                                    fullmatch=True),
                                                      python_values, max_size=4)))
    else:
        family = draw(st.sampled_from(["gpt", "llama"]))
        model = ModelSpec(
            family=family, layers=layers, hidden=heads * 8 * draw(st.integers(1, 4)), heads=heads,
            kv_heads=draw(st.sampled_from([None, heads, max(1, heads // 2) if tp <= heads // 2
                                           or heads // 2 % tp == 0 else heads])),
            ffn=(8 * tp * draw(st.integers(1, 8))) if family == "llama" or draw(st.booleans())
            else None,
            vocab=draw(st.integers(1, 70000)), max_seq=draw(st.sampled_from([128, 4096])),
            norm=draw(st.sampled_from([None, "layernorm", "rmsnorm"])),
            activation=draw(st.sampled_from([None, "gelu", "relu"]
                                            + (["swiglu"] if family == "llama" else []))),
            tied_embeddings=draw(st.sampled_from([None, True, False])),
            bias=draw(st.sampled_from([None, True, False])), dropout=draw(fraction),
            rope_theta=draw(positive), norm_eps=draw(positive))
    gpus = tp * pp * dp
    nodes = draw(st.sampled_from([n for n in (1, 2, 3) if gpus % n == 0]))
    if draw(st.booleans()):
        hardware = HardwareSpec.preset(
            draw(st.sampled_from(sorted(PRESETS))), nodes=nodes, gpus_per_node=gpus // nodes,
            **draw(st.fixed_dictionaries({}, optional={
                "hbm_bytes": positive, "mem_bandwidth": positive,
                "achievable_fraction": st.floats(0.01, 1.0),
                "attention_fraction": st.floats(0.01, 1.0),
                "intra": st.builds(LinkSpec, bandwidth=positive, latency=positive)})))
    else:
        hardware = HardwareSpec(
            gpu="custom", nodes=nodes, gpus_per_node=gpus // nodes, hbm_bytes=draw(positive),
            peak_flops={"fp32": draw(positive), "bf16": draw(positive), "fp16": draw(positive)},
            mem_bandwidth=draw(positive), nvlink_sharp=draw(st.booleans()),
            intra=LinkSpec(bandwidth=draw(positive), latency=draw(positive)),
            inter=LinkSpec(bandwidth=draw(positive), latency=draw(positive)),
            achievable_fraction=draw(st.floats(0.01, 1.0)))
    micro_batch = draw(st.integers(1, 4))
    microbatches = pp * draw(st.integers(1, 3))
    checkpoint = draw(st.sampled_from(["none", "full", "selective", "auto", "per-layer"]))
    if checkpoint == "per-layer":
        n = layers if model.family != "custom" else draw(st.integers(1, 12))
        checkpoint = tuple(draw(st.lists(st.sampled_from(LAYER_CHECKPOINT_POLICIES),
                                         min_size=n, max_size=n)))
    parallel = ParallelSpec(
        tp=tp, pp=pp, dp=dp, zero=draw(st.integers(0, 3)),
        sequence_parallel=draw(st.booleans()) and tp > 1, schedule=schedule, virtual_stages=v,
        microbatches=draw(st.sampled_from([None, microbatches])), checkpoint=checkpoint,
        overlap=draw(st.booleans()), order=tuple(draw(st.permutations(AXES))),
        shards=tuple(ShardRule(pattern=p, style=s) for p, s in draw(st.lists(
            st.tuples(text, st.sampled_from(["colwise", "rowwise", "replicate", "vocab"])),
            max_size=2))))
    optimizer = draw(st.one_of(
        st.builds(OptimizerSpec, name=st.just("adamw"), lr=positive, eps=positive,
                  weight_decay=fraction, betas=st.tuples(fraction, fraction)),
        st.builds(OptimizerSpec, name=st.just("sgd"), lr=positive, momentum=fraction,
                  weight_decay=fraction)))
    kind = draw(st.sampled_from(["constant", "cosine", "linear"]))
    lr_schedule = LRScheduleSpec(
        kind=kind, warmup=draw(st.integers(0, 1000)),
        min_lr=0.0 if kind == "constant" else draw(fraction),
        decay_steps=None if kind == "constant" else draw(st.sampled_from([None, 500])))
    data = draw(st.one_of(st.builds(DataSpec, kind=st.just("synthetic"), seed=st.integers(0, 99)),
                          st.builds(DataSpec, kind=st.just("tokens"), path=text,
                                    dtype=st.sampled_from(["uint16", "uint32"]))))
    init = draw(st.one_of(st.builds(InitSpec, kind=st.just("random"), seed=st.integers(0, 99)),
                          st.builds(InitSpec, kind=st.just("state_dict"), path=text)))
    train = TrainSpec(
        seq_len=draw(st.integers(1, 128)), global_batch=micro_batch * dp * microbatches,
        micro_batch=micro_batch, dtype=draw(st.sampled_from(sorted(hardware.peak_flops)))
        if set(hardware.peak_flops) <= {"fp32", "bf16", "fp16"} else "fp32",
        steps=draw(st.integers(1, 10**6)), grad_clip=draw(st.sampled_from([None, 1.0, 0.5])),
        optimizer=optimizer, lr_schedule=lr_schedule, data=data, init=init)
    checkpoint_dir = draw(st.sampled_from([None, "ckpt", "/a b/\"c\""]))
    runtime = RuntimeSpec(
        backend=draw(st.sampled_from(["auto", "nccl", "gloo"])), checkpoint_dir=checkpoint_dir,
        checkpoint_every=draw(st.sampled_from([None, 100])),
        checkpoint_interval=draw(st.sampled_from([None, 1800.0, 0.25, 12345.678])),
        keep=draw(st.integers(1, 9)), async_save=draw(st.booleans()),
        nan_policy=draw(st.sampled_from(["stop", "skip"] + (["rollback"] if checkpoint_dir
                                                             else []))),
        metrics=draw(st.sampled_from([None, "m.jsonl"])), seed=draw(st.integers(0, 2**40)),
        log_every=draw(st.integers(1, 100)), gc_every=draw(st.sampled_from([None, 1, 50])))
    try:
        return Plan(model=model, hardware=hardware, parallel=parallel, train=train,
                    runtime=runtime)
    except PlanError:
        reject()


@ROUND_TRIP
@given(plans())
def test_generated_plans_round_trip(plan: Plan) -> None:
    text = dump_plan(plan)
    again = parse(text, "dumped.ptc")
    assert again == plan, text
    assert dump_plan(again) == text
