"""`train.fp8_recipe = rowwise | mxfp8` (emulated) trains with tp = 2 as without; so does
every recipe with sequence parallelism's collectives as collective matmuls (tp_comm = async).

The tiny GPT and Llama (2 layers, hidden 64, sequence 64) train 5 AdamW steps in fp8 with
each recipe, at tp = 1, tp = 2 and tp = 2 with sequence parallelism. Every scale vector
whose contraction dimension tp splits is reduced (max) over the tp group (rowwise: x's and
W's rows in a row-parallel linear's forward, dy's rows and W's columns in a column-parallel
linear's dgrad), the others are whole on each rank, and mxfp8's 32-element blocks lie within
a rank's shard and sequence chunk: each rank quantises every element to the float8 value
an unsplit run gives it. What differs is the order of the fp32/bf16 sums, as between tp 2
and tp 1 in bf16, so the bound is `test_fp8_training`'s: losses within 2^-6 relative (two
bf16 ulps near 4), every parameter within 2·lr·steps (Adam moves an element by at most
about lr a step).
"""

from __future__ import annotations

import pytest
from fp8_helpers import assert_trains_as_tp1, run_fp8_recipe_cases

from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed

RECIPES = ("rowwise", "mxfp8")
FAMILIES = ("gpt", "llama")
ASYNC = ("sp", "async")
"""Sequence parallelism's collectives as collective matmuls (`ptc.ops.async_tp_fp8`)."""
TWO = [(f, 2, r, *sp) for f in FAMILIES for r in RECIPES for sp in ((), ("sp",))] \
    + [(f, 2, r, *ASYNC) for f in FAMILIES for r in ("tensorwise", *RECIPES)]
ONE = [(f, 1, r) for f in FAMILIES for r in ("tensorwise", *RECIPES)]


@pytest.fixture(scope="module")
def runs() -> dict:
    """tp = 2 cases in one launch of two processes, tp = 1 cases in one launch of one."""
    out = dict(run_local(run_fp8_recipe_cases, 2, TWO)[0])
    out.update(run_local(run_fp8_recipe_cases, 1, ONE)[0])
    return out


@pytest.mark.parametrize("sp", [(), ("sp",)], ids=["tp2", "tp2+sp"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_tp2_trains_as_tp1(runs, recipe, family, sp):
    one, two = runs[(family, 1, recipe)], runs[(family, 2, recipe, *sp)]
    assert any(f"fp8_linear ({recipe}" in line for line in two["log"]), two["log"]
    assert_trains_as_tp1(one, two)


@pytest.fixture(scope="module")
def split_gemms() -> dict:
    """One linear's three GEMMs split over tp 2 against the same linear whole."""
    from fp8_helpers import split_gemm_worker

    return run_local(split_gemm_worker, 2, RECIPES)[0]


@pytest.mark.parametrize("role", ["column", "row"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_split_gemms_quantise_as_the_whole_linear(split_gemms, recipe, role):
    """Tighter than training: a float8 value that differed from the unsplit run's (a scale
    from the rank's half of a row) moves its products by up to 2^-4 of their magnitude, far
    beyond the fp32 bound of summing the same products in another order (each figure is the
    largest |split - whole| over that bound: at most 1)."""
    ratios = split_gemms[recipe, role]
    assert max(ratios.values()) <= 1, ratios


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("recipe", ("tensorwise", *RECIPES))
def test_collective_matmuls_train_as_tp1(runs, recipe, family):
    """tp 2 with tp_comm = async: each chunk quantised with the whole tensor's scales, so
    the same float8 values as tp 1 multiply; the same bound as the other layouts."""
    one, two = runs[(family, 1, recipe)], runs[(family, 2, recipe, *ASYNC)]
    assert any("tp collectives run in ring steps beside their GEMMs" in line
               for line in two["log"]), two["log"]
    assert_trains_as_tp1(one, two)


@pytest.fixture(scope="module")
def collective_matmuls() -> dict:
    from fp8_helpers import collective_matmul_worker

    return run_local(collective_matmul_worker, 2, ("tensorwise", *RECIPES))[0]


@pytest.mark.parametrize("recipe", ("tensorwise", *RECIPES))
def test_collective_matmuls_multiply_the_float8_values_of_the_ops_they_replace(
        collective_matmuls, recipe):
    """Op by op, tighter than training: outputs, input and weight gradients of the float8
    collective matmuls against all_gather_seq + fp8_linear and fp8_linear +
    reduce_scatter_seq, within the fp32 bound of summing the same products in another
    order (relative to each tensor's largest element; at most 1)."""
    assert collective_matmuls[recipe] <= 1, collective_matmuls

