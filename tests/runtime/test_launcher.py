"""The torchrun command line `ptc run` builds, and detecting a launched worker."""

from __future__ import annotations

import pytest
from runtime_helpers import ROOT

from ptc.runtime.launcher import in_worker, launcher_args

pytestmark = pytest.mark.timeout(10)


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

    import torch.distributed.run

    from ptc.runtime import launcher

    for name in ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                 "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)
    seen = {}
    monkeypatch.setattr(torch.distributed.run, "run", lambda args: seen.update(os.environ))
    plan = tmp_path / "p.ptc"
    plan.write_text((ROOT / "examples" / "tiny_gpt_cpu.ptc").read_text()
                    .replace("backend = gloo", f"backend = {backend}"))
    assert launcher.launch(str(plan), 8, log_dir=str(tmp_path / "logs")) == 0
    dump = seen.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if backend == "gloo":
        assert dump is None
    else:
        assert dump == str(tmp_path / "logs" / "traces" / "nccl_trace_rank_")
        assert seen["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
