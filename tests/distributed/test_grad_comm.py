"""`parallel.grad_comm = fp8`: the data-parallel gradient reduction moves float8 bytes.

Two gloo processes (dp 2), tiny Llama, two micro-batches per rank, 5 AdamW steps.

Bytes on the wire. Every collective a rank issues is logged with the bytes it
hands in (`ptc.ops.comm.record_collectives`), and turned into the bytes that
rank sends on a ring of w ranks: an all-reduce of B bytes sends 2(w−1)/w·B, a
reduce-scatter or all-to-all of B (w−1)/w·B, an all-gather of b (w−1)·b. With
bf16 gradients (`train.grad_dtype = bf16`) at ZeRO 0 (all-reduce) and ZeRO 1
and 2 (reduce-scatter), the fp8 run's gradient traffic is half the bf16 run's:
one byte an element instead of two, plus one fp32 scale per bucket and rank.
ZeRO-1's reduce-scatter itself sends half of ZeRO-0's all-reduce.

Training. fp8 rounds each gradient element to 3 mantissa bits (e4m3: relative
error at most 2^-4 per rounding) or 2 (e5m2: 2^-3), twice on an all-reduce
(the sent values, then the sums): a relative perturbation of each step's
update of at most ε = 2·2^-4 = 2^-3 (e4m3) or 2^-2 (e5m2). To first order
that changes how far the loss has moved by at most that fraction, so step k's
loss stays within ε · Σ_{j<k} |L(j+1) − L(j)| of the unquantised run's (fp32
compute, so nothing else differs), plus the fp32 reference's own bound for
the summation order of the loss. The fp8 runs must also differ from the
unquantised one (the bytes were really rounded).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dist_helpers import MODELS, tiny_plan
from ptc.plan import Plan
from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed

DP = 2
BYTES_CASES = [(comm, zero, "bf16") for zero in (0, 1, 2) for comm in ("none", "fp8")]
LOSS_CASES = [(comm, zero, "fp32") for zero in (1, 2) for comm in ("none", "fp8", "fp8_e5m2")]
EPSILON = {"fp8": 2 * 2**-4, "fp8_e5m2": 2 * 2**-3}
"""Largest relative change of a gradient element the wire format makes (module docstring)."""


def comm_plan(case: tuple[str, int, str]) -> Plan:
    """The tiny Llama on 2 dp ranks: `comm` on the wire, ZeRO `zero`; "bf16": bf16 compute and
    gradients, "fp32": fp32 throughout."""
    comm, zero, dtype = case
    base = tiny_plan("llama", zero=zero, dp=DP, accum=2, dtype=dtype)
    return dataclasses.replace(
        base, parallel=dataclasses.replace(base.parallel, grad_comm=comm),
        train=dataclasses.replace(base.train, grad_dtype=dtype))


def train_logged(cases: list) -> dict:
    """Worker: train each case, logging its collectives; rank 0 returns losses, weights, log."""
    import torch.distributed as dist

    from ptc.lower.driver import compile_plan
    from ptc.ops.comm import record_collectives
    from ptc.runtime.executor import Trainer
    from ptc.runtime.mesh import axis_process_groups, build_mesh, init_distributed

    results = {}
    for case in cases:
        plan = comm_plan(case)
        init_distributed(plan)
        trainer = Trainer(compile_plan(plan), axis_process_groups(build_mesh(plan)), models=MODELS)
        with record_collectives() as log:
            losses = [trainer.train_step(k).loss for k in range(plan.train.steps)]
        state = trainer.full_state_dict()
        if dist.get_rank() == 0:
            results[case] = {"losses": losses, "state": state, "log": list(log)}
    dist.destroy_process_group()
    return results


def gradient_wire_bytes(log: list, world: int) -> float:
    """Bytes this rank sent, on a ring of `world` ranks, for the logged gradient reductions:
    all-reduces and reduce-scatters of more than a few elements (the NaN guard's flags and
    the clip's norm are scalars), and the float8 path's all-to-alls and all-gathers of bytes
    and of its one-element scales (the weights' all-gather after the step moves 2-byte
    elements, and is the same in both runs)."""
    share = {"all_reduce": 2 * (world - 1) / world, "reduce_scatter": (world - 1) / world,
             "all_to_all": (world - 1) / world, "all_gather": world - 1}

    def gradient(op: str, numel: int, nbytes: int) -> bool:
        if op in ("all_reduce", "reduce_scatter"):
            return numel > 16
        return op == "all_to_all" or nbytes == numel or numel == 1
    return sum(share[op] * nbytes for op, _, numel, nbytes in log if gradient(op, numel, nbytes))


_runs: dict = {}


def _run() -> dict:
    if not _runs:
        _runs.update(run_local(train_logged, DP, BYTES_CASES + LOSS_CASES)[0])
    return _runs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_fp8_halves_the_bytes_of_bf16_gradients(zero: int) -> None:
    bf16 = gradient_wire_bytes(_run()[("none", zero, "bf16")]["log"], DP)
    fp8 = gradient_wire_bytes(_run()[("fp8", zero, "bf16")]["log"], DP)
    assert bf16 > 0
    # One byte an element instead of two, plus a 4-byte scale per bucket and rank.
    assert fp8 / bf16 == pytest.approx(0.5, rel=0.01), (fp8, bf16)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("comm", ["none", "fp8"])
def test_zero1_reduce_scatters_half_the_bytes_of_zero0(comm: str) -> None:
    # ZeRO-1 sums each gradient only into the shard its rank updates: a reduce-scatter,
    # (w-1)/w of the buffer on the wire, where ZeRO-0's all-reduce sends 2(w-1)/w.
    zero0 = gradient_wire_bytes(_run()[(comm, 0, "bf16")]["log"], DP)
    zero1 = gradient_wire_bytes(_run()[(comm, 1, "bf16")]["log"], DP)
    assert zero0 > 0
    assert zero1 / zero0 == pytest.approx(0.5, rel=0.01), (zero1, zero0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("comm", ["fp8", "fp8_e5m2"])
def test_fp8_losses_stay_within_the_first_order_bound(comm: str, zero: int) -> None:
    exact = _run()[("none", zero, "fp32")]
    got = _run()[(comm, zero, "fp32")]
    ref = exact["losses"]
    moved = 0.0
    for k, (a, b) in enumerate(zip(ref, got["losses"])):
        bound = EPSILON[comm] * moved + 8 * torch.finfo(torch.float32).eps * abs(a)
        assert abs(b - a) <= bound, f"step {k + 1}: {b} vs {a}, bound {bound}"
        if k + 1 < len(ref):
            moved += abs(ref[k + 1] - a)
    differs = any(not torch.equal(got["state"][name], exact["state"][name])
                  for name in exact["state"])
    assert differs, "the fp8 run trained exactly like the unquantised one: nothing was rounded"
