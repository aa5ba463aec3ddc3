"""`parallel.offload = optimizer`: masters and Adam state on the host train exactly as without.

Tiny Llama on 2 gloo processes, two micro-batches per rank, 5 AdamW steps
with global-norm clipping at 1.0: ZeRO 1, 2 and 3 in fp32, and ZeRO 1 and 3
in bf16 (where ZeRO 1 keeps an fp32 master beside the bf16 weights and
ZeRO-3 gathers its fp32 shard), each trained with and without offload in
the same launch.

Tolerance: none — the losses and every parameter must be bit-equal. Here
the device is the CPU, so offload changes where nothing is computed: the
gradient shard is copied fp32 to fp32 (exact), the norm's partial sums are
the same `pow(2).sum()` of the same tensors in the same order, and the clip
and torch's AdamW run the same CPU kernels on the same fp32 values; the
cast of the updated master into the graph's weights is the same `copy_`.
(On a GPU the CPU's Adam may round differently from the CUDA kernels in
the last bit; that is not what this test can see.)

The bytes each rank holds equal `Program.state_bytes()` (device optimizer
state 0, host: fp32 master, fp32 gradient and two moments per element of
the shard). A checkpoint written with offload loads without it and one
written without loads with it: every weight and moment bit-equal, and the
next steps' losses equal those of the run that saved, going on
uninterrupted.

The offloaded update pipelines over units and lets the next step begin
before the last weights have come back (ZeRO-3: a shard's first gather
waits for it). On a CPU device a copy runs only when its landing is waited
for (`ptc.runtime.host_copies`), the latest an asynchronous copy may land,
so a forward that read a weight before its update landed would read the
old one here. The weights every stage's first forward reads in every step
— the graph's parameters at ZeRO 1-2, what its gathers return at ZeRO-3 —
are recorded on every rank and must equal the non-offloaded run's bit for
bit, at dp 2 and under pp 2 × dp 2 (1F1B, the GPT's tied embedding on both
stages). The control turns the device-side waits into no-ops: then the
reads of step 2 on differ, which shows the recording sees a missing wait.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_helpers import STEPS, tiny_plan
from offload_helpers import ReadCase, read_weights_worker, same_reads

from ptc.errors import PlanError
from ptc.lower.driver import compile_plan
from ptc.plan import ParallelSpec, Plan
from ptc.runtime.launcher import run_local

pytestmark = pytest.mark.distributed

DP = 2
CASES = [(zero, "fp32") for zero in (1, 2, 3)] + [(1, "bf16"), (3, "bf16")]
SAVED, MORE = 2, 2


def offload_plan(case: tuple[int, str, str]) -> Plan:
    """The tiny Llama at ZeRO `zero` in `dtype` on 2 dp ranks, `offload` none or optimizer."""
    zero, dtype, offload = case
    base = tiny_plan("llama", zero=zero, dp=DP, accum=2, dtype=dtype)
    return dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, offload=offload))


def run_offload_cases(cases: list) -> dict:
    """Worker: train every case (`dist_helpers.train_cases`)."""
    from dist_helpers import train_cases

    return train_cases(cases, offload_plan)


def swap_worker(directories: dict[str, str]) -> dict:
    """Worker: per offload setting, train SAVED steps, checkpoint into directories[offload],
    train MORE; then restore each checkpoint under the other setting and train MORE."""
    import torch.distributed as dist
    from ckpt_helpers import _checkpointer, _trainer, full_state, layout

    other = {"none": "optimizer", "optimizer": "none"}
    saved, loaded = {}, {}
    for offload in other:
        plan = offload_plan((2, "fp32", offload))
        trainer = _trainer(plan)
        for k in range(SAVED):
            trainer.train_step(k)
        checkpointer = _checkpointer(trainer, directories[offload])
        checkpointer.save(SAVED, SAVED * plan.train.global_batch, {"layout": layout(plan)})
        checkpointer.close()
        saved[offload] = {"state": full_state(trainer), "after": [
            trainer.train_step(SAVED + k).loss for k in range(MORE)]}
    for offload, written_by in other.items():
        trainer = _trainer(offload_plan((2, "fp32", offload)))
        manifest = _checkpointer(trainer, directories[written_by]).restore()
        loaded[offload] = {"step": manifest.step, "state": full_state(trainer), "after": [
            trainer.train_step(manifest.step + k).loss for k in range(MORE)]}
    dist.destroy_process_group()
    return {"saved": saved, "loaded": loaded}


_runs: dict = {}


def _run() -> dict:
    if not _runs:
        cases = [(zero, dtype, offload) for zero, dtype in CASES
                 for offload in ("none", "optimizer")]
        _runs.update(run_local(run_offload_cases, DP, cases)[0])
    return _runs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=[f"zero{z} {d}" for z, d in CASES])
def test_offloaded_training_is_bit_equal(case: tuple[int, str]) -> None:
    zero, dtype = case
    plain, offloaded = _run()[(zero, dtype, "none")], _run()[(zero, dtype, "optimizer")]
    assert len(offloaded["losses"]) == STEPS
    assert offloaded["losses"] == plain["losses"]
    assert offloaded["state"].keys() == plain["state"].keys()
    for name, value in plain["state"].items():
        assert torch.equal(offloaded["state"][name], value), f"zero{zero} {dtype}: {name}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=[f"zero{z} {d}" for z, d in CASES])
def test_held_bytes_move_to_the_host(case: tuple[int, str]) -> None:
    zero, dtype = case
    plain, offloaded = _run()[(zero, dtype, "none")], _run()[(zero, dtype, "optimizer")]
    assert offloaded["held"] == offloaded["predicted"]
    assert plain["held"] == plain["predicted"]
    held, before = offloaded["held"], plain["held"]
    assert (held["params"], held["grads"]) == (before["params"], before["grads"])
    assert held["optimizer"] == 0 and before["host"] == 0
    P = compile_plan(offload_plan((zero, dtype, "optimizer"))).layout.numel
    assert P % DP == 0  # the tiny Llama shards without padding
    # What the device drops: the moments, and in bf16 at ZeRO-1 the fp32 master too.
    assert before["optimizer"] == (12 if (dtype, zero) == ("bf16", 1) else 8) * P // DP
    assert held["host"] == 16 * P // DP  # fp32 master, fp32 gradient, two moments


@pytest.mark.timeout(300)
def test_checkpoints_load_with_and_without_offload(tmp_path) -> None:
    directories = {o: str(tmp_path / o) for o in ("none", "optimizer")}
    got = run_local(swap_worker, DP, directories)[0]
    for offload, written_by in (("none", "optimizer"), ("optimizer", "none")):
        loaded, saved = got["loaded"][offload], got["saved"][written_by]
        assert loaded["step"] == SAVED
        assert loaded["state"].keys() == saved["state"].keys()
        for name, value in saved["state"].items():
            assert torch.equal(loaded["state"][name], value), f"{offload} <- {written_by}: {name}"
        assert loaded["after"] == saved["after"], f"{offload} <- {written_by}"


READ_CASES = {2: [ReadCase(1), ReadCase(3, "bf16")], 4: [ReadCase(1, pp=2), ReadCase(3, pp=2)]}


@pytest.fixture(scope="module")
def reads() -> dict:
    """Every read case with and without offload; dp 2 alone with the controls too."""
    out = {}
    for world, cases in READ_CASES.items():
        runs = [c for case in cases for c in (case, dataclasses.replace(case, offload="none"))]
        if world == 2:
            runs += [dataclasses.replace(case, waits=False) for case in cases]
        out.update(run_local(read_weights_worker, world, runs)[0])
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", [c for cases in READ_CASES.values() for c in cases], ids=str)
def test_each_forward_reads_the_updated_weights(reads, case: ReadCase) -> None:
    offloaded, plain = reads[case], reads[dataclasses.replace(case, offload="none")]
    assert offloaded["losses"] == plain["losses"], case
    assert all(len(r) == 3 for r in offloaded["reads"])  # every step recorded, every rank
    assert same_reads(offloaded["reads"], plain["reads"]) == []


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", READ_CASES[2], ids=str)
def test_a_forward_that_does_not_wait_is_seen(reads, case: ReadCase) -> None:
    unwaited, plain = reads[dataclasses.replace(case, waits=False)], \
        reads[dataclasses.replace(case, offload="none")]
    wrong = same_reads(unwaited["reads"], plain["reads"])
    assert wrong and not any(" step 1 " in where for where in wrong), wrong
    assert unwaited["losses"][0] == plain["losses"][0] != unwaited["losses"][1]


def test_offload_without_zero_is_refused_in_one_line() -> None:
    with pytest.raises(PlanError) as error:
        ParallelSpec(dp=2, zero=0, offload="optimizer")
    first = str(error.value).splitlines()[0]
    assert first == ("parallel.offload: error: offload = optimizer needs zero 1-3: each rank "
                     "offloads the shard of the optimizer it owns, got zero = 0")
