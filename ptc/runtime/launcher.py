"""Starting one process per rank with PyTorch's elastic launcher (torchrun).

`launch(plan, write_plan, nproc, extra_launcher_args)` is what `ptc run PLAN`
calls with the plan it read (overrides applied): it picks the run's log
folder, has `write_plan` (handed in from above: the runtime reads and writes
no plan text) write the plan there as the file the workers read, and hands
torchrun's parser `--nproc-per-node`, the user's launcher flags (`--nnodes`,
`--node-rank`, `--rdzv-endpoint`, ... pass through unchanged; without them
the job is `--standalone` on this machine) and the worker module
`ptc.worker` with that file; the elastic agent then starts each rank as
`run_local` does, forked from the fork server (`start_ranks`). (When we already are a launched worker —
`torchrun ... -m ptc run PLAN` — the command line trains in this process
instead.)

`run_local(fn, nproc, *args)` starts `fn(*args)` on nproc local processes
through `elastic_launch` and returns each rank's return value; a failing
rank stops the others and raises `RankError` with its message. The processes
fork from multiprocessing's fork server, which imports torch once (`PRELOADED`)
instead of every rank importing it again, and each takes the launching
process's environment as it is at the launch (`_take_environment`). Like a
spawned process, each imports the script that called it, so a script must
call it (and `ptc.run`) under `if __name__ == "__main__":`; where a started
process reaches such a call while importing, it exits with one line that says
so (`refuse_while_spawning`) instead of starting processes of its own.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ptc.plan import Plan
from ptc.runtime.launch_log import (agent_quiet, error_text, how_it_ended, lost_a_peer,
                                   root_failure)


_FORK_SERVER_ENVIRONMENT = dict(os.environ)
"""The environment this module was imported with: in a rank, the fork server's, which it
inherited when the first launch started it (`_take_environment`)."""

def _stream_identity(fd: int) -> tuple[int, int] | None:
    """(device, inode) of the file open as `fd`, or None when it is not open."""
    try:
        info = os.fstat(fd)
    except OSError:
        return None
    return info.st_dev, info.st_ino


_FORK_SERVER_STREAMS = {fd: _stream_identity(fd) for fd in (1, 2)}
"""The files stdout and stderr were when this module was imported: in a rank, the fork
server's, which it inherited when the first launch started it (`_take_streams`)."""

_own_log = {1: False, 2: False}
"""Whether this rank's stdout and stderr are its own log files (`_take_streams`)."""

PRELOADED = ("torch", "torch.distributed", "torch.fx", "torch.export",
             "torch.distributed.checkpoint", "torch._dynamo", "ptc.runtime.launcher")
"""What the fork server imports once, before it forks the ranks of every local launch: an
8-rank launch on 2 cores takes 0.4 s forked against 6 s where each rank imports torch."""

PEER_LOST_GRACE_S = 2.0
"""How long a rank that failed for want of a peer waits before it exits (`_call`)."""

WORKER_MODULE = "ptc.worker"
"""The module each launched process runs (above the runtime: it compiles the plan)."""

PlanWriter = Callable[[Plan, Path], Path]
"""`write_plan(plan, folder)`: writes the plan into the run's folder as the file the workers
read and returns its path (`ptc.worker.write_plan`)."""

_RENDEZVOUS_FLAGS = ("--rdzv-endpoint", "--rdzv_endpoint", "--nnodes", "--master-addr",
                     "--master_addr", "--standalone")


UNGUARDED_CALL = ("ptc: a worker process reached a call that starts processes (ptc.run) while "
                  "importing the script that started it; make that call under "
                  "`if __name__ == \"__main__\":` (each worker process imports the script)")
"""What a spawned process says when the script it imports starts processes unguarded."""


def refuse_while_spawning() -> None:
    """Exit saying UNGUARDED_CALL when this is a started process still importing its
    parent's script, before it compiles anything: the call it reached would start processes
    again. `_inheriting` is the flag multiprocessing itself checks for this
    (`multiprocessing.spawn._check_not_importing_main`). The line is printed here: a
    process forked by the fork server exits without printing its SystemExit's message."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # One write of the whole line: the ranks print it at once into one pipe, and print's
        # separate writes of text and newline would interleave into one line.
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), f"{UNGUARDED_CALL}\n".encode())
        raise SystemExit(1)


PR_SET_PDEATHSIG = 1
"""prctl(2)'s option: the signal the kernel sends a process when its parent dies."""


def die_with_parent() -> None:
    """Have the kernel kill this process (SIGKILL) when the process that started it dies.

    A rank whose launcher or elastic agent is killed (by an out-of-memory
    killer, or with its login node) would otherwise live on as an orphan,
    training or waiting on its peers forever and holding its ports, memory
    and shared-memory buffers. SIGKILL, not a signal it could handle: a rank
    blocked in a collective runs no handler. The parent of a `ptc run` rank is
    the elastic agent (the `ptc run` process); of a `run_local` rank the fork
    server, which exits when its launcher does. Linux only (prctl); elsewhere
    nothing changes.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:  # it died before the kernel was told
        os.kill(os.getpid(), signal.SIGKILL)


def in_worker() -> bool:
    """Whether this process was started by torchrun / the elastic agent."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ)


def launcher_args(plan_path: str, nproc: int, extra: Sequence[str] = ()) -> list[str]:
    """The torchrun command line (without "torchrun") that runs the plan file `plan_path` on
    nproc processes."""
    args = [f"--nproc-per-node={nproc}"]
    if not any(a.split("=")[0] in _RENDEZVOUS_FLAGS for a in extra):
        args.append("--standalone")
    if not any(a.split("=")[0] in ("--max-restarts", "--max_restarts") for a in extra):
        args.append("--max-restarts=0")  # a training failure is not fixed by restarting it
    return [*args, *extra, "-m", WORKER_MODULE, plan_path]


def launch(plan: Plan, write_plan: PlanWriter, nproc: int | None = None,
           extra_launcher_args: Sequence[str] = (), log_dir: str | None = None) -> int:
    """Run `plan` on nproc local processes (per node); return the exit code.

    nproc defaults to tp * cp * pp * dp divided by the plan's nodes. Every
    worker's output goes to files under `log_dir` (default: the plan's
    checkpoint_dir/logs, else a new temporary folder) and rank 0's stdout
    to the terminal too (`ptc.runtime.launch_log`); `write_plan` puts the
    plan there as the file every worker reads, so that the workers train
    this very plan, overrides included, without reading the user's file.
    When a rank fails, the others are stopped and one summary names it, its
    error (step, graph node, source line) and the log folder; with
    `--max-restarts=N` the agent restarts the group instead, up to N times,
    saying which rank failed, and the workers resume from the latest
    checkpoint. With `--nnodes=MIN:MAX` the workers adapt dp to the
    processes that joined (`ptc.runtime.elastic`). Stopped by a signal (Ctrl-C,
    SIGTERM), the agent stops the workers and this says so in one line and
    returns 128 + the signal's number, as a shell does (130 for Ctrl-C).
    """
    from ptc.runtime.health import configure_flight_recorder  # noqa: PLC0415
    from ptc.runtime.mesh import backend_for, world_size  # noqa: PLC0415

    if nproc is None:
        nproc = max(1, world_size(plan) // plan.hardware.nodes)
    from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: PLC0415
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: PLC0415
    from torch.distributed.run import parse_args  # noqa: PLC0415

    from ptc.runtime import launch_log  # noqa: PLC0415
    from ptc.runtime.elastic import ENV, is_elastic_range  # noqa: PLC0415

    flags = {name.replace("_", "-"): value for name, value in
             (a.split("=", 1) for a in extra_launcher_args if "=" in a)}
    logs = _log_folder(plan, flags.get("--log-dir") or log_dir)
    plan_file = write_plan(plan, logs)
    extra = [*extra_launcher_args, *launch_log.log_launcher_args(logs, list(extra_launcher_args),
                                                                   nproc)]
    if backend_for(plan) == "nccl":  # the workers inherit it, before their groups exist
        configure_flight_recorder(logs / "traces")
    # The agent and the workers read these. Sharing the rendezvous store with the workers
    # leaves the previous attempt's addresses in it, so a restarted group can connect to
    # dead peers (pytorch/pytorch#135712): each attempt gets its own store instead.
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE":
           os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"),
           ENV: "1" if is_elastic_range(flags.get("--nnodes")) else None,
           # torchrun's own default for several workers, without its warning banner
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    saved = {name: os.environ.get(name) for name in env}
    _set_environment(env)
    narrator, loggers = launch_log.narrate(logs, int(flags.get("--node-rank", 0)), nproc)
    try:
        start_ranks(parse_args(launcher_args(str(plan_file), nproc, extra)))
    except ChildFailedError as exc:
        print(launch_log.failure_summary(exc, logs, int(flags.get("--max-restarts", 0))),
              file=sys.stderr)
        return 1
    except SignalException as exc:  # Ctrl-C or a kill of the launcher: the agent stopped them
        print(f"ptc run: stopped by {exc.sigval.name}; the workers were stopped with it "
              f"(their logs: {logs})", file=sys.stderr)
        return 128 + int(exc.sigval)
    finally:
        launch_log.restore(narrator, loggers)
        _set_environment(saved)
        _remove_snapshots(plan)
    return 0


def _remove_snapshots(plan: Plan) -> None:
    """Free the host memory of the job's in-memory snapshots on this node once its launcher
    is done, however it ended: they serve the restarts of this job; a new job resumes from
    storage."""
    if plan.runtime.checkpoint_dir:
        from ptc.runtime.snapshot import snapshot_folder  # noqa: PLC0415

        shutil.rmtree(snapshot_folder(plan.runtime.checkpoint_dir), ignore_errors=True)


def start_ranks(args) -> None:
    """Run the job torchrun's parsed command line `args` describes, as `torchrun` would (its
    `--standalone` and port defaults, its launch config), but each rank forked from the fork
    server (`PRELOADED`) with the launcher's environment (`_call`) rather than a new
    interpreter importing torch: the worker module's `main(argv)` is called in the rank."""
    from torch.distributed.launcher.api import elastic_launch  # noqa: PLC0415
    from torch.distributed.run import config_from_args  # noqa: PLC0415

    if args.standalone:  # as torch.distributed.run.run: a c10d store on a free local port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = \
            "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    multiprocessing.set_forkserver_preload(list(PRELOADED))
    elastic_launch(config, _call)(_module_main, (args.training_script,
                                                 list(args.training_script_args)), {},
                                  dict(os.environ), os.getpid())


def _module_main(module: str, argv: list[str]) -> int:
    """A rank of `ptc run`: `module.main(argv)` (the worker, named: the runtime imports no
    module above it)."""
    return importlib.import_module(module).main(argv)


def _log_folder(plan: Plan, asked: str | None) -> Path:
    """The run's folder for every rank's output and the plan the workers read: the one
    asked for, else the plan's checkpoint_dir/logs, else a new temporary folder."""
    if asked:
        return Path(asked)
    if plan.runtime.checkpoint_dir:
        return Path(plan.runtime.checkpoint_dir, "logs")
    return Path(tempfile.mkdtemp(prefix="ptc-logs-"))


def _set_environment(values: dict[str, str | None]) -> None:
    """Set (or, for None, remove) environment variables."""
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def run_local(fn: Callable[..., Any], nproc: int, *args: Any, **kwargs: Any) -> dict[int, Any]:
    """Run `fn(*args, **kwargs)` on nproc local processes; return {rank: return value}."""
    refuse_while_spawning()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: PLC0415
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch  # noqa: PLC0415

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          run_id=f"ptc-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                          start_method="forkserver")
    multiprocessing.set_forkserver_preload(list(PRELOADED))  # read when the server starts
    try:
        with agent_quiet():
            returned = elastic_launch(config, _call)(fn, args, kwargs, dict(os.environ),
                                                     os.getpid())
        return {rank: pickle.loads(value) for rank, value in returned.items()}
    except ChildFailedError as exc:
        from ptc.runtime.executor import RankError  # noqa: PLC0415

        raise RankError(_failure_text(exc)) from None


def _call(fn: Callable[..., Any], args: tuple, kwargs: dict, environment: dict,
          launcher: int) -> Any:
    """A rank's entry: the launcher's (process `launcher`'s) environment and output streams,
    a thread count, then `fn`."""
    import torch  # noqa: PLC0415

    _release_fork_server()
    die_with_parent()
    _take_environment(environment)
    _take_streams(launcher)
    # A rank compiles what the launching process compiled (and warned about) already: said
    # once there, not again by every rank.
    logging.getLogger("ptc").setLevel(logging.ERROR)
    # As torchrun does: n processes with all cores' threads each would oversubscribe. Set
    # here, not left to OpenMP, which read the fork server's environment when it loaded.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - every failure ends the rank so
        _fail(exc)
    # Pickled here, tensors with their bytes: handed back as they are, each tensor would
    # travel as a shared-memory segment whose file the launcher keeps open while the
    # value lives, thousands over a test session (more than `ulimit -n`).
    return pickle.dumps(result)


def _fail(exc: BaseException) -> None:
    """End a failed rank: its error in the error file the launcher reads, its traceback in
    its own log (its stderr, where the agent redirected it), exit code 1. Not left to
    multiprocessing, which would print the traceback on the launcher's terminal once the
    agent has put the rank's streams back. A rank that failed for want of a peer that
    failed first waits a moment, so that the launcher sees that one go first and names it
    as the cause."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler  # noqa: PLC0415

    if lost_a_peer(exc):
        time.sleep(PEER_LOST_GRACE_S)
    ErrorHandler().record_exception(exc)
    if _own_log[2]:  # the launcher's own stream: the error file holds it for the summary
        traceback.print_exception(exc, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _take_streams(launcher: int) -> None:
    """Write this rank's stdout and stderr where the launcher's go now, where the elastic
    agent left them as they came (not redirected to the log files). They came from the fork
    server, which kept the streams of when it started (the first launch): a terminal, or
    a file a test captured output in, maybe gone since. Each is reopened for appending
    through /proc (Linux); where that fails (a socket) it stays."""
    for fd in (1, 2):
        _own_log[fd] = _stream_identity(fd) != _FORK_SERVER_STREAMS[fd]
        if _own_log[fd]:
            continue  # the agent redirected it to the rank's log file
        try:
            target = os.open(f"/proc/{launcher}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue
        (sys.stdout if fd == 1 else sys.stderr).flush()
        os.dup2(target, fd)
        os.close(target)


def _release_fork_server() -> None:
    """Close this rank's copy of the launcher's end of the fork server's liveness pipe.

    The fork server exits when every copy of that end is closed, and each
    process it forks inherits one (to fork processes of its own through it):
    kept by the ranks, it would keep the server alive after its launcher was
    killed, and the ranks, whose parent it is, would outlive it too
    (`die_with_parent`). A rank starts no processes through it."""
    from multiprocessing import forkserver  # noqa: PLC0415

    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def _take_environment(launcher: dict[str, str]) -> None:
    """Make this rank's environment the launching process's as it was at the launch, plus
    what the elastic agent set for this rank (its rank, world size, store address, ...).
    A rank forks from the fork server, which kept the environment of when it started (the
    first launch): what the launcher changed since (a timeout, a fault to inject) would
    otherwise not reach it, and what it removed would linger."""
    set_by_agent = {name: value for name, value in os.environ.items()
                    if _FORK_SERVER_ENVIRONMENT.get(name) != value}
    os.environ.clear()
    os.environ.update(launcher)
    os.environ.update(set_by_agent)


def _failure_text(exc: Exception) -> str:
    """The first failed rank's error message (the root cause), with where its traceback was
    kept; else the launcher's summary."""
    if not getattr(exc, "failures", None) and not hasattr(exc, "get_first_failure"):
        return str(exc)
    rank, failure = root_failure(exc)
    message, stack = failure.message, ""
    if isinstance(message, dict):
        stack = message.get("extraInfo", {}).get("py_callstack", "")
        message = message.get("message", message)
    if failure.exitcode < 0:  # a signal: the process could record nothing
        return f"rank {rank} {how_it_ended(failure.exitcode)}"
    if not os.path.isfile(failure.error_file):
        # No record: it failed before its worker ran, or exited on its own.
        return (f"rank {rank} exited with code {failure.exitcode} and recorded no error; "
                "its own output above says why")
    first, _, rest = error_text(message).removeprefix(f"rank {rank}: ").partition("\n")
    where = f" [traceback: {_kept_traceback(stack, rank)}]" if stack else ""
    return f"rank {rank} failed (exit code {failure.exitcode}): {first}{where}" + (
        f"\n{rest}" if rest else "")


def _kept_traceback(stack: str, rank: int) -> Path:
    """The failed rank's traceback, written to a file that outlives the launch (its error
    file is the launcher's temporary one): the error names it instead of printing it."""
    path = Path(tempfile.mkdtemp(prefix="ptc-failure-")) / f"rank{rank}_traceback.txt"
    path.write_text(stack)
    return path
