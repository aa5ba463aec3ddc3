"""`ptc explain`'s communication buckets: predicted from the profile, as the pass makes them."""

from __future__ import annotations

import dataclasses
import io

import pytest
from rich.console import Console

from ptc.compiler.graph.meta import graph_record
from ptc.compiler.records.layout import layout_of
from ptc.compiler.records.overlap import GRAD_BYTES
from ptc.compiler.cost.buckets import predicted_buckets
from ptc.lower.driver import compile_plan
from ptc.compiler.profile.cache import model_profile
from ptc.views.explain import render_explain
from ptc.plan import HardwareSpec, ModelSpec, ParallelSpec, Plan, TrainSpec
from ptc.units import format_bytes

pytestmark = pytest.mark.timeout(120)


def gpt_plan(*, zero: int, bucket_size="auto", overlap: bool = True) -> Plan:
    return Plan(model=ModelSpec(family="gpt", layers=3, hidden=32, heads=4, vocab=64, max_seq=16),
                hardware=HardwareSpec.preset("cpu", gpus_per_node=2),
                parallel=ParallelSpec(dp=2, zero=zero, bucket_size=bucket_size, overlap=overlap),
                train=TrainSpec(seq_len=16, global_batch=4, micro_batch=2, dtype="fp32"))


def predicted(plan: Plan):
    return predicted_buckets(plan, model_profile(plan.model, plan.train.dtype), layout_of(plan), 0)


def test_a_layer_bucket_carries_the_compiled_layer_unit():
    plan = gpt_plan(zero=2, bucket_size=1.0)  # nothing merges
    _, buckets = predicted(plan)
    program = compile_plan(plan)
    layout = program.layout
    layer = next(i for i, u in enumerate(layout.units) if u.name == "layers.1")
    predicted_layer = next(b for b in buckets if b.items == ("layers.1",))
    # The compiled unit is padded to a multiple of dp; the profile counts elements.
    assert predicted_layer.grad_bytes == GRAD_BYTES * layout.units[layer].numel


def test_a_tied_head_never_shares_the_embedding_s_zero3_bucket():
    plan = gpt_plan(zero=3, bucket_size=1e9)  # everything else merges
    _, buckets = predicted(plan)
    assert [b.items for b in buckets] == [("embedding", "layers.0", "layers.1", "layers.2"),
                                         ("norm + head",)]
    compiled = graph_record(compile_plan(plan).stages[0].graph).overlap
    assert len(compiled.buckets) == len(buckets)


@pytest.mark.parametrize("zero,collective", [(3, "2 gathers + reduce-scatter"),
                                             (2, "reduce-scatter"),
                                             (1, "reduce-scatter (once per step)"),
                                             (0, "all-reduce (once per step)")])
def test_explain_shows_the_bucket_size_rows_and_what_overlaps(zero, collective):
    plan = gpt_plan(zero=zero)
    size, buckets = predicted(plan)
    out = io.StringIO()
    Console(file=out, width=400).print(render_explain(plan))
    text = " ".join(out.getvalue().split())  # titles wrap over lines
    title = text[text.index("Communication buckets over dp"):]
    assert title.startswith(f"Communication buckets over dp: bucket_size {format_bytes(size)} "
                            "(auto = min(9 x latency x bandwidth of the dp link, largest unit)")
    assert f"{collective} each" in title
    for bucket in buckets:
        if len(bucket.items) > 1:
            assert " + ".join(bucket.items) in title
    if zero == 3:
        assert "gather starts while the previous layer computes" in title
    off = io.StringIO()
    Console(file=off, width=400).print(render_explain(dataclasses.replace(
        plan, parallel=dataclasses.replace(plan.parallel, overlap=False))))
    assert "Overlap off: every collective is waited for as soon as it is issued." in \
        " ".join(off.getvalue().split())
