"""What `ptc run` says about failed workers: one summary, one line per restart."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
from runtime_helpers import tiny_plan  # noqa: F401 - puts the repo root on sys.path

from ptc.runtime.launch_log import AgentNarrator, failure_summary, log_launcher_args

pytestmark = pytest.mark.timeout(30)


@dataclass
class Failure:
    message: object
    exitcode: int
    error_file: str


class Failed(Exception):
    def __init__(self, rank: int, failure: Failure):
        super().__init__("failed")
        self.first = rank, failure

    def get_first_failure(self):
        return self.first


def _error_file(folder: Path, attempt: int, rank: int, message: str) -> Path:
    path = folder / "run_x" / f"attempt_{attempt}" / str(rank) / "error.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"message": {"message": message}}))
    (path.parent / "stderr.log").write_text("Traceback (most recent call last): ...\n")
    return path


def test_the_summary_names_the_rank_its_error_and_its_traceback(tmp_path):
    error = _error_file(tmp_path, 0, 1, "RankError: rank 1: IndexError: index out of range\n"
                                        "  at step 3, micro-batch 1, forward of stage 0")
    failure = Failure({"message": "RankError: rank 1: IndexError: index out of range\n  at step "
                                  "3, micro-batch 1, forward of stage 0"}, 1, str(error))
    assert failure_summary(Failed(1, failure), tmp_path, 0) == (
        f"ptc run: rank 1 stopped the job: IndexError: index out of range [traceback: "
        f"{error.with_name('stderr.log')}]\n  at step 3, micro-batch 1, forward of stage 0")
    killed = Failure("Signal 9 (SIGKILL) received by PID 7", -9, str(tmp_path / "none.json"))
    assert failure_summary(Failed(0, killed), tmp_path, 2) == (
        f"ptc run: rank 0 stopped the job after 2 restarts: was killed by SIGKILL (as the "
        f"kernel's out-of-memory killer does: `dmesg` says) [every rank's output: {tmp_path}]")


def test_a_restart_is_one_line_naming_the_rank_that_failed(tmp_path, capsys):
    _error_file(tmp_path, 0, 1, "PtcError: step 4: non-finite loss")
    narrator = AgentNarrator(tmp_path, node_rank=1, nproc=2)  # node 1: ranks 2 and 3
    def record(msg, *args):
        return logging.LogRecord("torch.distributed", logging.INFO, __file__, 1, msg, args, None)
    narrator.emit(record("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
                         1, 1, 99, "python"))
    narrator.emit(record("[%s] Worker group %s. %s/%s attempts left; will restart worker group",
                         "default", "FAILED", 3, 3))
    narrator.close()
    assert capsys.readouterr().err == ("ptc run: rank 3 exited with code 1 (step 4: non-finite "
                                       "loss); restarting the group: restart 1 of 3, resuming "
                                       "from the latest checkpoint\n")
    assert "Worker group FAILED" in (tmp_path / "agent.log").read_text()


def test_every_rank_but_the_first_writes_both_streams_to_files(tmp_path):
    assert log_launcher_args(tmp_path, [], 3) == [f"--log-dir={tmp_path}",
                                                  "--redirects=0:2,1:3,2:3"]
    assert log_launcher_args(tmp_path, ["--tee=3"], 3) == []  # the user's own choice


def test_ptc_run_from_python_names_the_ranks_error_once_and_keeps_its_traceback(tmp_path):
    # run_local's RankError: the rank's own error (without a ptc error's type name and the
    # rank it already names), the file holding its traceback, then the error's later lines.
    from ptc.runtime.launcher import _failure_text

    error = _error_file(tmp_path, 0, 1, "unused")
    message = {"message": "RankError: rank 1: IndexError: index out of range\n  at step 3",
               "extraInfo": {"py_callstack": "Traceback (most recent call last): ...\n"}}
    text = _failure_text(Failed(1, Failure(message, 1, str(error))))
    first, second = text.splitlines()
    assert first.startswith("rank 1 failed (exit code 1): IndexError: index out of range "
                            "[traceback: ") and second == "  at step 3"
    kept = Path(first.split("[traceback: ")[1].rstrip("]"))
    assert kept.read_text() == "Traceback (most recent call last): ...\n"
