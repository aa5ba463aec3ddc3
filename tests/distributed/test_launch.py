"""`ptc run PLAN` end to end: torchrun processes, data files, state-dict init, metrics, failures.

Each test starts 2 gloo processes through PyTorch's elastic launcher.
Losses are compared with eager training within the bounds `tests/tolerances.py`
derives from the same training in float64.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ptc
from dist_helpers import ROOT, fail_on_rank_1, reference, tiny_plan

from ptc import worker
from ptc.cli import main
from ptc.lower.driver import compile_plan
from ptc.dsl import dump_plan
from ptc.models import build_model
from ptc.plan import DataSpec, InitSpec
from ptc.runtime.executor import RankError
from ptc.runtime.launcher import UNGUARDED_CALL, launch, run_local
from tests.tolerances import assert_losses_match

pytestmark = pytest.mark.distributed


@pytest.fixture(autouse=True)
def importable_ptc(monkeypatch):
    # A plan file's factory may name modules of the repository: on the path for every rank.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("PTC_TIMEOUT", "60")


def write_plan(tmp_path, plan) -> str:
    path = tmp_path / "plan.ptc"
    path.write_text(dump_plan(plan))
    return str(path)


def read_metrics(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(120)
def test_plan_file_with_token_data_and_state_dict_trains_like_eager(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 64, 2000).astype(np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    torch.save(build_model(tiny_plan("gpt", zero=2, dp=2, accum=2).model, device="cpu",
                           seed=99).state_dict(), tmp_path / "init.pt")
    plan = tiny_plan("gpt", zero=2, dp=2, accum=2, metrics=str(tmp_path / "metrics.jsonl"),
                     data=DataSpec(kind="tokens", path=str(tmp_path / "train.bin"), dtype="uint16"),
                     init=InitSpec(kind="state_dict", path=str(tmp_path / "init.pt")))
    assert launch(plan, worker.write_plan, nproc=2) == 0
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert_losses_match([r["loss"] for r in records], reference(plan), "ptc run")
    assert [r["step"] for r in records] == list(range(1, plan.train.steps + 1))
    assert all(r["predicted_step_time"] > 0 and r["tokens_per_s"] > 0 for r in records)


@pytest.mark.timeout(120)
def test_failing_rank_stops_the_job_and_names_rank_and_cause(tmp_path, capsys):
    # Rank 1 reads samples 2 and 3 (tokens 32..64): ids >= vocab there make it refuse its
    # batch while rank 0 waits in the gradient all-reduce; the launcher must stop both.
    # (`launch` itself does not scan the file first, as `ptc run` does.)
    tokens = np.full(200, 5, dtype=np.uint16)
    tokens[33:65] = 500
    tokens.tofile(tmp_path / "bad.bin")
    plan = tiny_plan("gpt", zero=0, dp=2, accum=1,
                     data=DataSpec(kind="tokens", path=str(tmp_path / "bad.bin")))
    assert launch(plan, worker.write_plan, nproc=2, log_dir=str(tmp_path / "logs")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith(f"ptc run: rank 1 stopped the job: train.data: token file "
                             f"{tmp_path / 'bad.bin'}: token 500 at position 33 is outside the "
                             f"vocabulary")
    trace = err[0].split("[traceback: ")[1].rstrip("]")
    assert trace.startswith(str(tmp_path / "logs")) and "Traceback" in Path(trace).read_text()
    assert err[1:] == ["  at step 1, micro-batch 0, forward of stage 0"]  # one summary


def test_ptc_run_scans_the_token_file_before_any_process_starts(tmp_path, capsys):
    tokens = np.full(200, 5, dtype=np.uint16)
    tokens[150] = 64
    tokens.tofile(tmp_path / "bad.bin")
    plan = tiny_plan("gpt", zero=0, dp=2, accum=1,
                     data=DataSpec(kind="tokens", path=str(tmp_path / "bad.bin")))
    assert main(["run", write_plan(tmp_path, plan)]) != 0
    err = capsys.readouterr().err
    assert "token 64 at position 150 is outside the vocabulary" in err
    assert "rank" not in err and "Traceback" not in err  # refused here, in one line


@pytest.mark.timeout(120)
def test_launch_inside_torchrun_trains_in_the_worker(tmp_path):
    plan = tiny_plan("llama", zero=3, dp=2, accum=1, steps=2,
                     metrics=str(tmp_path / "metrics.jsonl"))
    script = tmp_path / "entry.py"
    script.write_text("import sys\nfrom ptc.cli import main\n"
                      "raise SystemExit(main(['run', sys.argv[1]]))\n")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(script), write_plan(tmp_path, plan)],
        capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 2
    assert result.stdout.count("step 2/2") == 1  # rank 0 reports, once


@pytest.mark.timeout(120)
def test_python_api_runs_a_program_on_local_processes():
    plan = tiny_plan("llama", zero=3, dp=2, accum=2)
    result = ptc.run(compile_plan(plan))
    assert_losses_match(result.losses, reference(plan), "ptc.run(program)")
    assert result.held_bytes["params"] == compile_plan(plan).state_bytes()["params"]


def tensors_of_rank(count: int) -> list:
    """Worker: `count` small tensors, as the equivalence tests' workers hand back weights."""
    return [torch.full((64,), float(i)) for i in range(count)]


@pytest.mark.timeout(120)
def test_values_handed_back_hold_no_open_file_each():
    # Kept, as a test module keeps its ranks' results: no descriptor may stay open for each
    # tensor in them (thousands over a session would pass `ulimit -n 1024`).
    before = len(os.listdir("/proc/self/fd"))
    kept = [run_local(tensors_of_rank, 2, 50) for _ in range(3)]
    assert all(torch.equal(got[1][7], torch.full((64,), 7.0)) for got in kept)
    assert len(os.listdir("/proc/self/fd")) - before < 20


def environment_of_rank(names: tuple[str, ...]) -> dict:
    """Worker: the values (None where unset) of `names` in this rank's environment."""
    return {name: os.environ.get(name) for name in (*names, "RANK", "WORLD_SIZE")}


@pytest.mark.timeout(120)
def test_each_launch_hands_its_ranks_the_environment_it_has_then(monkeypatch):
    # The ranks fork from a server started by the first launch: what the launcher set or
    # removed since must reach them all the same, beside the agent's own variables.
    names = ("PTC_ENV_SET_LATER", "PTC_ENV_REMOVED_LATER")
    monkeypatch.setenv("PTC_ENV_REMOVED_LATER", "first")
    first = run_local(environment_of_rank, 2, names)
    assert first[1] == {"PTC_ENV_SET_LATER": None, "PTC_ENV_REMOVED_LATER": "first",
                        "RANK": "1", "WORLD_SIZE": "2"}
    monkeypatch.delenv("PTC_ENV_REMOVED_LATER")
    monkeypatch.setenv("PTC_ENV_SET_LATER", "second")
    later = run_local(environment_of_rank, 2, names)
    assert [later[rank] for rank in (0, 1)] == [
        {"PTC_ENV_SET_LATER": "second", "PTC_ENV_REMOVED_LATER": None, "RANK": str(rank),
         "WORLD_SIZE": "2"} for rank in (0, 1)]


@pytest.mark.timeout(120)
def test_a_script_calling_run_without_a_main_guard_is_told_so_in_one_line(tmp_path):
    # Workers import the script afresh: each reaches ptc.run again and must stop there
    # (not start processes of its own, nor compile), saying why.
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import ptc\n"
        "plan = ptc.Plan(model=ptc.ModelSpec(family='gpt', layers=2, hidden=32, heads=2,\n"
        "                                    vocab=64, max_seq=16),\n"
        "                hardware=ptc.HardwareSpec.preset('cpu', gpus_per_node=2),\n"
        "                parallel=ptc.ParallelSpec(dp=2),\n"
        "                train=ptc.TrainSpec(seq_len=16, global_batch=4, dtype='fp32', steps=1))\n"
        "ptc.run(plan)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=110, cwd=tmp_path)
    assert done.returncode != 0
    lines = done.stderr.splitlines()
    said = [line for line in lines if line == UNGUARDED_CALL]
    assert 1 <= len(said) <= 2  # each rank that got that far, before the others were stopped
    assert lines[-1].startswith("ptc.runtime.executor.RankError: rank ")
    assert lines[-1].endswith("recorded no error; its own output above says why")
    assert "bootstrapping phase" not in done.stderr  # multiprocessing's own, longer story


@pytest.mark.timeout(120)
def test_a_failed_rank_is_one_line_naming_its_error_and_where_its_traceback_is(capfd):
    # The launcher's own records (a traceback of its join, W/E lines) are not shown; the
    # rank's error is, and its traceback is kept in a file the error names.
    with pytest.raises(RankError) as raised:
        run_local(fail_on_rank_1, 2, "raise")
    message = str(raised.value)
    assert message.startswith("rank 1 failed (exit code 1): ValueError: rank 1 fails on "
                              "purpose [traceback: ")
    kept = Path(message.split("[traceback: ")[1].rstrip("]"))
    assert kept.read_text().rstrip().endswith("ValueError: rank 1 fails on purpose")
    with pytest.raises(RankError, match=r"^rank 1 was killed by SIGKILL \(as the kernel's "
                                        r"out-of-memory killer does: `dmesg` says\)$"):
        run_local(fail_on_rank_1, 2, "kill")
    said = capfd.readouterr().err
    assert "Traceback" not in said and "torch/distributed" not in said, said


@pytest.mark.timeout(120)
def test_ctrl_c_stops_the_run_in_one_line_with_exit_130(tmp_path):
    """Ctrl-C on `ptc run` (SIGINT to the launcher while rank 0 trains): the workers are
    stopped, the launcher says so in one line, no traceback, and exits 130 as a shell
    does."""
    import signal  # noqa: PLC0415

    plan = tiny_plan("gpt", zero=1, dp=2, accum=1, steps=100000)
    job = subprocess.Popen([sys.executable, "-m", "ptc", "run", write_plan(tmp_path, plan),
                            "--log-dir", str(tmp_path / "logs")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in job.stdout:  # rank 0's steps reach the terminal
        if line.startswith("step "):
            break
    job.send_signal(signal.SIGINT)
    _, err = job.communicate(timeout=90)
    assert job.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert f"ptc run: stopped by SIGINT; the workers were stopped with it (their logs: " \
        f"{tmp_path / 'logs'}" in err


def _descendants(pid: int) -> list[int]:
    """The processes `pid` started, and theirs (every thread's children, from /proc)."""
    tasks = Path(f"/proc/{pid}/task")
    children = [int(child) for task in tasks.iterdir()
                for child in (task / "children").read_text().split()]
    return children + [d for child in children for d in _descendants(child)]


def _alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) and /proc are Linux-only")
def test_workers_die_within_seconds_of_a_killed_launcher(tmp_path):
    """`ptc run` SIGKILLed mid-run (as an out-of-memory killer or a lost login node would):
    its ranks, which would otherwise train on as orphans, are gone within 10 s, and so is
    the fork server that started them."""
    import signal  # noqa: PLC0415
    import time  # noqa: PLC0415

    plan = tiny_plan("gpt", zero=1, dp=2, accum=1, steps=100000)
    job = subprocess.Popen([sys.executable, "-m", "ptc", "run", write_plan(tmp_path, plan),
                            "--log-dir", str(tmp_path / "logs")],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in job.stdout:  # rank 0 trains
        if line.startswith("step "):
            break
    # The ranks, the fork server they come from and multiprocessing's resource tracker.
    ranks = _descendants(job.pid)
    assert len(ranks) >= 3, ranks
    job.kill()
    job.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in ranks if _alive(pid)]
    for pid in left:  # leave nothing running whatever the verdict
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their launcher by 10 s"
