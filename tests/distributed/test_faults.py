"""Fault injection on CPU gloo: killed rank, NaN gradient, damaged checkpoint, hung rank, elastic.

Faults come from the `PTC_FAULT` test hook (`ptc.runtime.faults`). Every
test is bounded: collectives time out (`PTC_TIMEOUT`), the launcher stops
the group when a rank dies, and each test has a pytest timeout.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import socket

import pytest
import torch
from ckpt_helpers import (
    GLOBAL_BATCH,
    ckpt_plan,
    damage_worker,
    guard_worker,
    run_worker,
    with_runtime,
)
from dist_helpers import ROOT

from ptc import worker
from ptc.runtime.checkpoint_store import CheckpointStore
from ptc.runtime.launcher import launch, run_local
from tests.tolerances import assert_losses_match

pytestmark = pytest.mark.distributed


@pytest.fixture(autouse=True)
def importable_ptc(monkeypatch):
    # A plan file's factory may name modules of the repository: on the path for every rank.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("PTC_TIMEOUT", "60")


def read_metrics(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def decisions(run: dict) -> list[str]:
    """What a rank decided about steps (saves are reported by rank 0 alone)."""
    return [e for e in run["events"] if e.startswith("step ")]


@pytest.mark.timeout(240)
def test_killed_rank_restarts_and_every_later_loss_equals_the_uninterrupted_run(
        tmp_path, monkeypatch, capfd):
    """Without snapshots the restarted group resumes from storage's latest checkpoint."""
    def plan(name):
        return ckpt_plan(dp=2, zero=1, steps=6, checkpoint_dir=str(tmp_path / name),
                         checkpoint_every=2, snapshot_every=None,
                         metrics=str(tmp_path / f"{name}.jsonl"))

    reference = run_local(run_worker, 2, [plan("whole")])[0][0]["losses"]
    monkeypatch.setenv("PTC_FAULT", "kill:1:5")  # rank 1 dies as step 5 starts, first attempt
    assert launch(plan("killed"), worker.write_plan, nproc=2,
                  extra_launcher_args=["--max-restarts=1"]) == 0
    records = read_metrics(tmp_path / "killed.jsonl")
    before = [r for r in records if r["restart"] == 0]
    after = [r for r in records if r["restart"] == 1]
    assert [r["step"] for r in before] == [1, 2, 3, 4]
    resumed = after[0]["step"] - 1
    assert resumed in (2, 4), "resumed from the checkpoint of step 2 or 4 (if its save finished)"
    assert [r["step"] for r in after] == list(range(resumed + 1, 7))
    for record in records:  # bit-identical, before and after the restart
        assert record["loss"] == reference[record["step"] - 1], record
    said = capfd.readouterr()
    assert f"resumed from step_{resumed:08d}" in said.out
    # torch's agent names the failure with the earliest timestamp: usually the killed rank,
    # but rank 0's error file (its collective failing for want of rank 1) can be stamped
    # before the agent notices the kill; either way the line names a rank and the restart.
    restart = ("; restarting the group: restart 1 of 1, resuming from the latest checkpoint")
    assert ("ptc run: rank 1 was killed by SIGKILL (as the kernel's out-of-memory killer "
            "does: `dmesg` says)" + restart in said.err
            or re.search(r"ptc run: rank 0 was killed by SIGTERM \(.+\)" + re.escape(restart),
                         said.err)), said.err
    assert "Traceback" not in said.err and "torch/distributed" not in said.err


@pytest.mark.timeout(240)
def test_a_hung_rank_is_noticed_named_and_restarted_within_30_s(tmp_path, monkeypatch, capfd):
    """A rank that hangs in the backward of step 5, with no timeout set (the collective
    timeout stays at its 300 s): the stall watchdog notices within 10 s (steps take well
    under a second), names the rank, where it is and what it was doing (micro-batch,
    action), and the group restarts and trains on from the latest
    checkpoint, every loss as the uninterrupted run's; the whole run takes at most 30 s more
    than that one."""
    import time  # noqa: PLC0415

    monkeypatch.delenv("PTC_TIMEOUT")

    def plan(name):
        return ckpt_plan(dp=2, zero=1, steps=6, checkpoint_dir=str(tmp_path / name),
                         checkpoint_every=2, metrics=str(tmp_path / f"{name}.jsonl"))

    start = time.monotonic()
    assert launch(plan("whole"), worker.write_plan, nproc=2) == 0
    clean = time.monotonic() - start
    reference = [r["loss"] for r in read_metrics(tmp_path / "whole.jsonl")]
    monkeypatch.setenv("PTC_FAULT", "hang@backward:1:5")  # first attempt only
    start = time.monotonic()
    assert launch(plan("hung"), worker.write_plan, nproc=2,
                  extra_launcher_args=["--max-restarts=1"]) == 0
    hung = time.monotonic() - start
    records = read_metrics(tmp_path / "hung.jsonl")
    assert [r["step"] for r in records if r["restart"] == 0] == [1, 2, 3, 4]
    assert [r["step"] for r in records if r["restart"] == 1] == [5, 6]  # from step 4's save
    for record in records:
        assert record["loss"] == reference[record["step"] - 1], record
    said = capfd.readouterr().err
    assert re.search(r"ptc run: rank [01] exited with code 1 \(step 5: no progress for 1\d s; "
                     r"rank 1 stalled in step 5 at ptc/runtime/faults\.py:\d+ in at_phase "
                     r"\(micro-batch 0, backward of stage 0\); "
                     r"rank\(s\) 0 wait\(s\) in a collective \(ptc/.+\)\); restarting the "
                     r"group: restart 1 of 1", said), said
    print(f"hung run {hung:.1f} s, uninterrupted {clean:.1f} s")
    assert hung - clean < 30, f"{hung:.1f} s against {clean:.1f} s uninterrupted"


def snapshot_plan(tmp_path, name):
    """16 steps of dp 2, snapshots every step, storage checkpoints every 8."""
    return ckpt_plan(dp=2, zero=1, steps=16, checkpoint_dir=str(tmp_path / name),
                     checkpoint_every=8, snapshot_every=1, metrics=str(tmp_path / f"{name}.jsonl"))


KILLS = [("forward", 1, 3, 2), ("backward", 0, 5, 4), ("optimizer", 1, 7, 6),
         ("snapshot", 0, 9, 8), ("start", 1, 13, 12)]
"""(phase, rank, step, the step resumed from): a kill in each attempt of one launch."""


@pytest.mark.timeout(300)
def test_a_rank_killed_anywhere_in_a_step_resumes_from_host_memory_losing_no_finished_step(
        tmp_path, monkeypatch, capfd):
    """snapshot_every = 1, storage checkpoints every 8 steps; one launch whose group a rank's
    SIGKILL stops five times, each in another part of a step: during the forward of step 3,
    the backward of step 5, the optimizer step of step 7, while writing its snapshot of step
    9, and as step 13 starts. Each time the group restarts from the snapshot of the last
    finished step (of step 8 when the one of step 9 was half written), not from storage;
    every loss is the uninterrupted run's. The run ending well removes the snapshots."""
    monkeypatch.setenv("PTC_SNAPSHOT_DIR", str(tmp_path / "shm"))
    reference = run_local(run_worker, 2, [snapshot_plan(tmp_path, "whole")])[0][0]["losses"]
    monkeypatch.setenv("PTC_FAULT", ",".join(f"kill@{phase}:{rank}:{step}:{attempt}" for
                                             attempt, (phase, rank, step, _) in enumerate(KILLS)))
    assert launch(snapshot_plan(tmp_path, "killed"), worker.write_plan, nproc=2,
                  extra_launcher_args=[f"--max-restarts={len(KILLS)}"]) == 0
    records = read_metrics(tmp_path / "killed.jsonl")
    resumed = [min(r["step"] for r in records if r["restart"] == attempt) - 1
               for attempt in range(1, len(KILLS) + 1)]
    assert resumed == [after for *_, after in KILLS], resumed
    assert [r["step"] for r in records if r["restart"] == len(KILLS)] == list(range(13, 17))
    for record in records:
        assert record["loss"] == reference[record["step"] - 1], record
    said = capfd.readouterr().out
    for step in resumed:
        assert re.search(rf"resumed from the in-memory snapshot of step {step} \(the newest "
                         rf"checkpoint in storage: (none|step_0000000\d)\): next sample "
                         rf"{step * GLOBAL_BATCH}\n", said), step
    assert not list((tmp_path / "shm").glob("*/*.safetensors"))


@pytest.mark.timeout(300)
def test_a_rank_killed_with_its_snapshot_resumes_from_its_peers_copy(tmp_path, monkeypatch,
                                                                    capfd):
    """Rank 1 killed as step 13 starts, its own snapshot lost with it (`wipe`, as with its
    node's memory): the group restarts from the copy its peer keeps, of step 12 (of 11 when
    step 12's was still on its way to the peer), not from storage's step 8, every loss as
    the uninterrupted run's."""
    monkeypatch.setenv("PTC_SNAPSHOT_DIR", str(tmp_path / "shm"))
    reference = run_local(run_worker, 2, [snapshot_plan(tmp_path, "whole")])[0][0]["losses"]
    monkeypatch.setenv("PTC_FAULT", "wipe:1:13")
    assert launch(snapshot_plan(tmp_path, "killed"), worker.write_plan, nproc=2,
                  extra_launcher_args=["--max-restarts=1"]) == 0
    records = read_metrics(tmp_path / "killed.jsonl")
    assert [r["step"] for r in records if r["restart"] == 0] == list(range(1, 13))
    after = [r["step"] for r in records if r["restart"] == 1]
    resumed = after[0] - 1
    assert resumed in (11, 12) and after == list(range(resumed + 1, 17)), after
    for record in records:
        assert record["loss"] == reference[record["step"] - 1], record
    said = capfd.readouterr().out
    assert (f"resumed from the in-memory snapshot of step {resumed} (the newest checkpoint in "
            f"storage: step_00000008): next sample {resumed * GLOBAL_BATCH}") in said
    assert not list((tmp_path / "shm").glob("*/*.safetensors"))


@pytest.mark.timeout(120)
def test_a_slow_rank_is_named_at_the_end_of_the_run_and_in_each_steps_record(tmp_path, capfd):
    """Rank 1 sleeps 0.1 s in each forward from step 2 on (a straggler; the other rank waits
    for it in the collectives): the records of those steps name rank 1 the slowest, its work
    more than 1.25 times the median rank's, and the run's closing lines name it."""
    plan = ckpt_plan(dp=2, zero=1, steps=4, metrics=str(tmp_path / "m.jsonl"))
    assert run_local(run_worker, 2, [plan], "slow:1:2")[0][0]["error"] is None
    records = read_metrics(tmp_path / "m.jsonl")
    assert [r["slowest_rank"] for r in records[1:]] == [1, 1, 1], records
    assert all(r["work_skew"] > 1.25 for r in records[1:]), records
    assert re.search(r"\nptc run: slower than the median rank's [\d.]+ ms of work per step "
                     r"\(time not waiting for collectives\): rank 1 [\d.]+ ms \(\+\d+%\)\n",
                     capfd.readouterr().out)


@pytest.mark.timeout(240)
def test_a_damaged_snapshot_is_said_and_the_run_resumes_from_storage(tmp_path, monkeypatch):
    """A run with snapshots stops at step 5 (a NaN, nan_policy = stop: its snapshots of step
    4, complete, stay); every snapshot file then has a byte of its data changed (the header
    still reads). The next run finds the damage by the files' checksums before any rank
    loads anything, says so, and resumes from storage's step 4, every loss as an
    uninterrupted run's."""
    monkeypatch.setenv("PTC_SNAPSHOT_DIR", str(tmp_path / "shm"))
    plan = ckpt_plan(dp=2, zero=1, steps=6, checkpoint_every=2, snapshot_every=1,
                     checkpoint_dir=str(tmp_path / "ckpt"))
    reference = run_local(run_worker, 2, [with_runtime(plan, checkpoint_dir=str(
        tmp_path / "whole"))])[0][0]["losses"]
    stopped = run_local(run_worker, 2, [plan], "nan:1:5")
    assert "nan_policy = stop" in stopped[0][0]["error"]
    files = list((tmp_path / "shm").glob("*/*.safetensors"))
    assert len(files) == 4  # each rank's own and the copy it keeps of its peer's
    for path in files:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    runs = run_local(run_worker, 2, [plan])
    for rank, (run,) in runs.items():
        assert run["error"] is None, run["error"]
        said = [e for e in run["events"] if "in-memory snapshot" in e]
        assert said == ["the in-memory snapshot of step 4 is not usable (rank 0: its snapshot "
                        "of step 4 is damaged; rank 1: its snapshot of step 4 is damaged): "
                        "resuming from storage"], said
        assert "resumed from step_00000004: step 4, next sample 32" in run["events"]
        assert run["losses"] == reference[4:], rank


@pytest.mark.timeout(240)
def test_a_failed_save_is_said_and_retried_and_training_goes_on(tmp_path):
    """Rank 1's part of step 4's checkpoint fails to write (a full disk), asynchronous and
    synchronous saves alike: every rank trains on to step 6 with the losses of a run
    without the fault, one line says what failed, step 4's partial save is gone, step 2
    stays the latest until step 6's save succeeds. In the same launch, checkpoint_every =
    auto: a save after the first step, which measures what a save costs, then at the
    Young/Daly interval it gives."""
    base = ckpt_plan(dp=2, zero=1, steps=6, checkpoint_every=2)
    plans = [with_runtime(base, async_save=mode == "async", checkpoint_dir=str(tmp_path / mode))
             for mode in ("async", "sync")]
    # In the same launch (the fault is step 4's): checkpoint_every = auto, 3 steps.
    auto = with_runtime(ckpt_plan(dp=2, zero=1, steps=3), checkpoint_every="auto",
                        checkpoint_dir=str(tmp_path / "auto"))
    clean = run_local(run_worker, 2, [with_runtime(base, checkpoint_dir=str(tmp_path / "clean"))])
    faulted = run_local(run_worker, 2, [*plans, auto], "savefail:1:4")
    auto_run = faulted[0][2]
    assert auto_run["error"] is None, auto_run["error"]
    said = [e for e in auto_run["events"] if e.startswith("checkpoint_every = auto")]
    assert len(said) == 1 and "(Young/Daly)" in said[0], auto_run["events"]
    # Saved after the first step (which measures the pause), then not again before the end:
    # the default MTBF of 2 CPU "GPUs" is years, and Young/Daly's interval with it.
    assert CheckpointStore(tmp_path / "auto").visible() == [3, 1]
    for mode, runs in zip(("async", "sync"), zip(*(r[:2] for r in faulted.values()))):
        for rank, run in enumerate(runs):
            assert run["error"] is None, (mode, rank, run["error"])
            assert run["losses"] == clean[rank][0]["losses"], (mode, rank)
        said = [e for e in runs[0]["events"] if "not saved" in e]
        assert said == ["step 4: checkpoint not saved (rank 1: OSError: [Errno 28] No space "
                        "left on device (injected)); the latest stays step_00000002; training "
                        "goes on and the next save tries again"], (mode, runs[0]["events"])
        store = CheckpointStore(tmp_path / mode)
        assert store.visible() == [6, 2], mode
        assert not store.partial_path(4).exists(), mode


@pytest.mark.timeout(240)
def test_nonfinite_gradient_every_rank_takes_the_same_action_under_each_policy(tmp_path):
    base = ckpt_plan(dp=2, zero=2, steps=6, checkpoint_every=2, keep=1)
    plans = [with_runtime(base, nan_policy=policy, checkpoint_dir=str(tmp_path / policy))
             for policy in ("stop", "skip", "rollback")]
    stop, skip, rollback = zip(*run_local(run_worker, 2, plans, "nan:1:3").values())

    assert stop[0]["error"] == stop[1]["error"]
    assert ("step 3: non-finite loss or gradient on rank(s) [1]; nan_policy = stop"
            in stop[0]["error"])
    assert CheckpointStore(tmp_path / "stop").visible() == [2]  # nothing non-finite was saved

    assert decisions(skip[0]) == decisions(skip[1]) and skip[0]["nonfinite"] == skip[1]["nonfinite"]
    assert skip[0]["nonfinite"] == [(), (), (1,), (), (), ()]
    assert "step 3: non-finite loss or gradient on rank(s) [1]: step skipped, no update" \
        in skip[0]["events"]
    assert all(torch.isfinite(torch.tensor(skip[0]["losses"][3:])))

    assert decisions(rollback[0]) == decisions(rollback[1])
    bad = 2 * GLOBAL_BATCH  # step 3's batch starts at sample 16
    assert (f"step 3: non-finite loss or gradient on rank(s) [1]: rolled back to step_00000002; "
            f"data resumes at sample {bad + GLOBAL_BATCH} (samples {bad}..{bad + GLOBAL_BATCH - 1}"
            f" skipped)") in rollback[0]["events"]
    assert rollback[0]["nonfinite"] == [(), (), (1,), (), (), (), ()]  # steps 1, 2, 3, 3..6
    assert all(torch.isfinite(torch.tensor(rollback[0]["losses"])).tolist()[3:])
    store = CheckpointStore(tmp_path / "rollback")
    assert store.visible() == [6] and store.verify(6) == []  # finite weights, saved at the end


@pytest.mark.timeout(120)
def test_pure_data_parallel_nan_is_caught_by_the_gradient_all_reduce_and_names_its_rank():
    # dp 2 at ZeRO-0 is the whole job: the guard rides the gradient all-reduce (FoldedGuard).
    steps = run_local(guard_worker, 2, ckpt_plan(dp=2, zero=0, steps=4, family="gpt"),
                      "nan:1:3")
    assert steps[0]["steps"] == steps[1]["steps"]  # the same decisions, losses and collectives
    got, buckets = steps[0]["steps"], steps[0]["buckets"]
    assert [s["nonfinite"] for s in got] == [(), (), (1,), ()]
    assert all(math.isfinite(s["loss"]) for s in got)  # the skipped step's loss still reported
    for s in got:  # one all-reduce per bucket, the last carrying a flag and a loss per rank
        assert len(s["all_reduce"]) == len(buckets), s["all_reduce"]
        assert sum(s["all_reduce"]) == sum(buckets) + 2 * 2


@pytest.mark.timeout(240)
def test_damaged_newest_checkpoint_resume_takes_the_previous_and_says_so(tmp_path):
    base = ckpt_plan(dp=2, zero=1, steps=4, checkpoint_every=2)
    plans = [with_runtime(base, checkpoint_dir=str(tmp_path / how))
             for how in ("corrupt", "truncate")]
    corrupt, truncate = run_local(damage_worker, 2, plans, ["corrupt", "truncate"], 6)[0]
    for got, problem in ((corrupt, "fails its CRC-32 check"),
                         (truncate, ".metadata has")):
        text = "\n".join(got["events"])
        assert "removed incomplete checkpoints step_00000006.partial" in text
        assert "checkpoint step_00000004 is damaged (" in text and problem in text
        assert "set aside as step_00000004.damaged, trying the previous one" in text
        assert "resumed from step_00000002: step 2, next sample 16" in text
        assert len(got["losses"]) == 4  # steps 3..6
    assert CheckpointStore(tmp_path / "corrupt").visible()[0] == 6


@pytest.mark.timeout(180)
def test_hung_rank_is_named_after_the_collective_timeout(tmp_path, monkeypatch, capsys):
    # A timeout below the stall watchdog's 10 s, so that the collective gives up first.
    monkeypatch.setenv("PTC_FAULT", "hang:1:2")
    monkeypatch.setenv("PTC_TIMEOUT", "3")
    plan = ckpt_plan(dp=2, zero=0, steps=3)
    assert launch(plan, worker.write_plan, nproc=2) == 1
    err = capsys.readouterr().err
    assert "ptc run: rank 0 stopped the job: step 2: a collective timed out after 3 s; " \
           "rank(s) 1 did not answer" in err


@pytest.mark.timeout(240)
def test_elastic_restart_on_fewer_processes_reshards_and_keeps_the_data_position(
        tmp_path, capfd):
    from dist_helpers import reference

    plan = ckpt_plan(dp=2, zero=1, steps=4, checkpoint_dir=str(tmp_path / "ckpt"),
                     checkpoint_every=2, metrics=str(tmp_path / "m.jsonl"))
    assert launch(plan, worker.write_plan, nproc=2) == 0
    longer = dataclasses.replace(plan, train=dataclasses.replace(plan.train, steps=6))
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    # One "node" of one process joins an elastic job for up to two: dp becomes 1.
    assert launch(longer, worker.write_plan, nproc=1, extra_launcher_args=[
        "--nnodes=1:2", f"--rdzv-endpoint=localhost:{port}", "--rdzv-backend=c10d",
        "--rdzv-conf=last_call_timeout=1"]) == 0
    out = capfd.readouterr().out
    assert "elastic job: 1 processes joined, so dp = 1 (the plan asks 2)" in out
    assert "resumed from step_00000004: step 4, next sample 32 (resharded from tp=1 pp=1 " \
           "dp=2 zero=1 to tp=1 pp=1 dp=1 zero=1)" in out
    records = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert_losses_match([r["loss"] for r in records], reference(longer),
                        "elastic restart on dp 1")
