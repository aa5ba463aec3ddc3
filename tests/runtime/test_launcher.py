"""The torchrun command line `ptc run` builds, the plan its workers read, and detecting a
launched worker."""

from __future__ import annotations

from pathlib import Path

import pytest
from runtime_helpers import ROOT

import ptc.dsl
from ptc.cli import main
from ptc.dsl import load_plan, parse
from ptc.dsl.paths import absolute_paths
from ptc.runtime.launcher import in_worker, launcher_args
from ptc.worker import write_plan

pytestmark = pytest.mark.timeout(10)

TINY = ROOT / "examples" / "tiny_gpt_cpu.ptc"


def test_single_node_is_standalone_without_restarts():
    assert launcher_args("p.ptc", 4) == ["--nproc-per-node=4", "--standalone", "--max-restarts=0",
                                         "-m", "ptc.worker", "p.ptc"]


def test_multi_node_flags_pass_through():
    extra = ["--nnodes=2", "--node-rank=1", "--rdzv-endpoint=host:29500", "--rdzv-backend=c10d"]
    args = launcher_args("p.ptc", 8, extra)
    assert "--standalone" not in args
    assert args[:2] == ["--nproc-per-node=8", "--max-restarts=0"]
    assert args[2:6] == extra and args[-3:] == ["-m", "ptc.worker", "p.ptc"]


def test_torchrun_flags_parse():
    from torch.distributed.run import parse_args

    parsed = parse_args(launcher_args("p.ptc", 2, ["--nnodes=2", "--node-rank=1",
                                                   "--rdzv-endpoint=host:29500"]))
    assert (parsed.nnodes, parsed.node_rank, parsed.rdzv_endpoint) == ("2", 1, "host:29500")
    assert parsed.module and parsed.training_script == "ptc.worker"


def test_worker_detection(monkeypatch):
    for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    assert not in_worker()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert in_worker()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")):
        monkeypatch.setenv(name, value)
    assert in_worker()


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_nccl_workers_get_the_flight_recorder_before_they_start(tmp_path, monkeypatch, backend):
    """Under NCCL the workers inherit where the flight recorder dumps (in the log folder),
    set before they create a process group; gloo ignores it and gets none."""
    import os

    from ptc.runtime import launcher

    for name in ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                 "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)
    seen = {}
    monkeypatch.setattr(launcher, "start_ranks", lambda args: seen.update(os.environ))
    plan = parse(TINY.read_text().replace("backend = gloo", f"backend = {backend}"))
    assert launcher.launch(plan, write_plan, 8, log_dir=str(tmp_path / "logs")) == 0
    dump = seen.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if backend == "gloo":
        assert dump is None
    else:
        assert dump == str(tmp_path / "logs" / "traces" / "nccl_trace_rank_")
        assert seen["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


@pytest.mark.timeout(120)
def test_ptc_run_reads_the_plan_once_and_the_workers_train_it_overrides_included(
        tmp_path, monkeypatch):
    """The launching process parses the plan file once, with the command line's overrides,
    and writes the result into the log folder; each worker reads that file alone and trains
    a plan equal to it, the file's relative paths still naming the files beside the plan."""
    from ptc.runtime import launcher, train
    from ptc.worker import main as worker_main

    for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "plans").mkdir()
    (tmp_path / "plans" / "p.ptc").write_text(TINY.read_text())  # metrics = "metrics.jsonl"
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    parses, real_parse = [], ptc.dsl.parse
    monkeypatch.setattr(ptc.dsl, "parse",
                        lambda *args, **kwargs: parses.append(args) or real_parse(*args, **kwargs))
    launched = []
    monkeypatch.setattr(launcher, "start_ranks", launched.append)  # no processes
    overrides = ["--train.steps", "3", "--parallel.tp", "2", "--parallel.dp", "4"]
    assert main(["run", "../plans/p.ptc", *overrides, "--log-dir", "logs"]) == 0
    assert len(parses) == 1

    command = launched[0]
    assert (command.training_script, command.training_script_args) == (
        "ptc.worker", [str(Path("logs") / "plan" / "p.ptc")])  # the run keeps the plan's name
    trained = []
    monkeypatch.setattr(train, "train_worker", lambda plan, **kwargs: trained.append(plan))
    assert worker_main(command.training_script_args) == 0
    resolved = load_plan("../plans/p.ptc", overrides={"train.steps": "3", "parallel.tp": "2",
                                                      "parallel.dp": "4"})
    assert trained == [absolute_paths(resolved)]
    plan = trained[0]
    assert (plan.train.steps, plan.parallel.tp, plan.parallel.dp) == (3, 2, 4)
    assert plan.runtime.metrics == str(tmp_path / "plans" / "metrics.jsonl")
