"""`ptc explain` names the dtype the data-parallel gradient reductions travel in.

With `parallel.grad_comm = fp8` (or `fp8_e5m2`) it names the float8 format
and the bytes a step that saves against the gradient dtype; without, the
gradient dtype itself. The bytes are the predicted buckets' (what the
estimate prices), at `Plan.grad_wire_bytes` an element.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from ptc.compiler.search.estimate import estimate
from ptc.compiler.records.overlap import GRAD_BYTES
from ptc.compiler.cost.buckets import predicted_buckets
from ptc.compiler.profile.cache import plan_profile, with_model_shape
from ptc.views.explain import WIRE_FORMATS, render_explain
from ptc.dsl import load_plan
from ptc.ops.fp8_comm import FORMATS
from ptc.units import format_bytes

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_gpt_cpu.ptc"


def explained(**overrides: str) -> tuple[str, int]:
    """(`ptc explain` of the tiny example with `overrides`, on one line; the gradient elements
    a rank of its one stage reduces)."""
    plan = with_model_shape(load_plan(TINY, overrides=overrides))
    out = io.StringIO()
    Console(file=out, width=1000).print(render_explain(plan))
    _, buckets = predicted_buckets(plan, plan_profile(plan), estimate(plan).layout, 0)
    return " ".join(out.getvalue().split()), sum(b.grad_bytes for b in buckets) // GRAD_BYTES


@pytest.mark.parametrize("dtype,size", [("fp32", 4), ("bf16", 2)])
def test_the_default_wire_is_the_gradient_dtype(dtype, size):
    text, elements = explained(**{"train.dtype": dtype, "train.grad_dtype": dtype})
    assert (f"Gradients cross dp in {dtype} (train.grad_dtype), {size} bytes an element: "
            f"stage 0 reduces {format_bytes(size * elements)} a rank, once per step.") in text
    assert "fp8" not in text


@pytest.mark.parametrize("comm,fmt", [("fp8", "e4m3"), ("fp8_e5m2", "e5m2")])
@pytest.mark.parametrize("dtype,size", [("fp32", 4), ("bf16", 2)])
def test_fp8_on_the_wire_says_its_format_and_what_it_saves(comm, fmt, dtype, size):
    text, elements = explained(**{"parallel.grad_comm": comm, "train.dtype": dtype,
                                  "train.grad_dtype": dtype})
    assert f"Gradients cross dp in fp8 {fmt} (parallel.grad_comm = {comm}: " in text
    assert (f"1 byte an element instead of {dtype}'s {size}: stage 0 reduces "
            f"{format_bytes(elements)} a rank instead of {format_bytes(size * elements)}, once "
            f"per step; {format_bytes((size - 1) * elements)} less a step.") in text


def test_zero2_reduces_every_micro_batch():
    text, elements = explained(**{"parallel.grad_comm": "fp8", "parallel.zero": "2"})
    micro = 16 // 8  # global_batch / dp, one sample each
    assert (f"instead of {format_bytes(4 * elements)}, every micro-batch, {micro} a step; "
            f"{format_bytes(3 * elements * micro)} less a step.") in text


def test_without_dp_there_is_no_gradient_reduction():
    text, _ = explained(**{"parallel.dp": "1", "hardware.gpus_per_node": "1"})
    assert "No gradient reduction over dp (dp = 1)" in text


def test_the_formats_named_are_those_the_reduction_uses():
    assert {comm: str(dtype).removeprefix("torch.float8_")[:4] for comm, dtype in
            FORMATS.items()} == WIRE_FORMATS
