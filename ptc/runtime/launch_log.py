"""What `ptc run` says while torch's elastic agent runs the workers: one story, no walls.

Every worker's stdout and stderr go to files under the run's log directory
(torchrun's `--log-dir`, `--redirects`) but local rank 0's stdout — its step
lines and events — which stays on the terminal. The agent's own
log records go to `agent.log` there instead of the terminal; a restart of
the group is told in one ptc line: which rank failed (its exit code or
signal, its error) and which restart of how many this is. When
the job ends in failure, `failure_summary` gives the first failed rank's
error — step, micro-batch, graph node and source line when the runtime knew
them — and where every rank's full output is.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import signal
import sys
from pathlib import Path
from typing import Any

AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run",
                 "torch.distributed.launcher")
"""The loggers of torch's launcher and elastic agent (torchrun's W/E lines)."""
_PTC_ERRORS = ("RankError: ", "PtcError: ", "PlanError: ", "CompileError: ")
"""Type prefixes of ptc's own errors: their messages already say what happened."""


def log_launcher_args(log_dir: Path, extra: list[str], nproc: int) -> list[str]:
    """torchrun flags that put every worker's output in files under `log_dir` but local rank
    0's stdout, left on the terminal; none when the user set the output flags themselves."""
    given = {a.split("=")[0].replace("_", "-") for a in extra}
    if given & {"--redirects", "-r", "--tee", "-t"}:
        return []
    files = ",".join(["0:2", *(f"{rank}:3" for rank in range(1, nproc))])  # 2 err, 3 both
    return ([] if "--log-dir" in given else [f"--log-dir={log_dir}"]) + [f"--redirects={files}"]


def error_text(message: object) -> str:
    """A failed worker's error as its error file holds it, without a ptc error's type name."""
    if isinstance(message, dict):
        message = message.get("message", message)
    text = str(message).strip()
    for prefix in _PTC_ERRORS:
        text = text.removeprefix(prefix)
    return text


def how_it_ended(exitcode: int) -> str:
    """`exited with code 1`, or `was killed by SIGTERM` for a negative (signal) code; SIGKILL
    says who usually sends it to a training process: the kernel, out of host memory."""
    if exitcode == -signal.SIGKILL:
        return "was killed by SIGKILL (as the kernel's out-of-memory killer does: `dmesg` says)"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


@contextlib.contextmanager
def agent_quiet():
    """Within: the launcher's and elastic agent's own log records (torchrun's W/E lines, a
    traceback of the agent's for a rank that died) are dropped; `run_local` raises the
    failed rank's error itself."""
    names = _loggers_under((*AGENT_LOGGERS, "torch.multiprocessing"))
    saved = {name: logging.getLogger(name).disabled for name in names}
    for name in names:
        logging.getLogger(name).disabled = True
    try:
        yield
    finally:
        for name, disabled in saved.items():
            logging.getLogger(name).disabled = disabled


def _loggers_under(tops: tuple[str, ...]) -> list[str]:
    """`tops` and every logger made so far below one of them, each once."""
    return list(dict.fromkeys(
        name for name in [*tops, *logging.root.manager.loggerDict]
        if any(name == top or name.startswith(top + ".") for top in tops)))


class AgentNarrator(logging.Handler):
    """Keeps the agent's records in `agent.log` and tells failures and restarts as ptc lines."""

    def __init__(self, log_dir: Path, node_rank: int, nproc: int) -> None:
        super().__init__(logging.DEBUG)
        self.log_dir, self.node_rank, self.nproc = log_dir, node_rank, nproc
        log_dir.mkdir(parents=True, exist_ok=True)
        self._file = logging.FileHandler(log_dir / "agent.log")
        self._file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: "
                                                  "%(message)s"))
        self._attempt = 0
        self._failed = ""

    def emit(self, record: logging.LogRecord) -> None:
        self._file.emit(record)
        text = str(record.msg)
        if text.startswith("failed (exitcode") and len(record.args or ()) >= 2:
            exitcode, local_rank = int(record.args[0]), int(record.args[1])
            rank = self.node_rank * self.nproc + local_rank
            error = self._error(local_rank)
            # The rank that failed first, not one that lost it as a peer (`PEER_LOST`).
            if not self._failed or lost_a_peer(self._failed):
                self._failed = f"rank {rank} {how_it_ended(exitcode)}" + (
                    f" ({error})" if error else "")
        elif "attempts left" in text and len(record.args or ()) >= 4:
            remaining, most = int(record.args[2]), int(record.args[3])
            self._attempt += 1
            self._say(f"{self._failed or 'a worker failed'}; restarting the group: restart "
                      f"{most - remaining + 1} of {most}, resuming from the latest checkpoint")
            self._failed = ""

    def close(self) -> None:
        self._file.close()
        super().close()

    def _error(self, local_rank: int) -> str:
        """The first line of the rank's error file in this attempt of the newest run in the
        folder (an earlier run may have left its own), if it wrote one."""
        paths = sorted(self.log_dir.glob(f"*/attempt_{self._attempt}/{local_rank}/error.json"),
                       key=lambda path: path.stat().st_mtime, reverse=True)
        for path in paths[:1]:
            try:
                text = error_text(json.loads(path.read_text()).get("message", ""))
            except (OSError, ValueError):
                return ""
            # The rank is named already: "rank 1: ..." says it twice.
            return re.sub(r"^rank \d+: ", "", text.splitlines()[0]) if text else ""
        return ""

    @staticmethod
    def _say(line: str) -> None:
        print(f"ptc run: {line}", file=sys.stderr, flush=True)


def narrate(log_dir: Path, node_rank: int, nproc: int) -> tuple[AgentNarrator, dict]:
    """Route the agent's loggers to an `AgentNarrator`; returns it and what to restore.

    Their own levels (torch sets WARNING on some) are lifted to inherit INFO from here, or
    the restart record would never be made."""
    narrator = AgentNarrator(log_dir, node_rank, nproc)
    saved = {}
    for name in _loggers_under(AGENT_LOGGERS):
        logger = logging.getLogger(name)
        saved[name] = (logger.propagate, list(logger.handlers), logger.level)
        if name in AGENT_LOGGERS:
            logger.handlers, logger.propagate = [narrator], False
            logger.setLevel(logging.INFO)
        else:
            logger.handlers, logger.propagate = [], True
            logger.setLevel(logging.NOTSET)
    return narrator, saved


def restore(narrator: AgentNarrator, saved: dict) -> None:
    """Undo `narrate`."""
    for name, (propagate, handlers, level) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers, logger.propagate = handlers, propagate
        logger.setLevel(level)
    narrator.close()


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "NCCL communicator was aborted", "remote process exited")
"""What a rank's error says when it failed because another rank went away first."""


def lost_a_peer(message: object) -> bool:
    """Whether a rank's error says it failed because another rank went away (`PEER_LOST`)."""
    return any(marker in str(message) for marker in PEER_LOST)


def root_failure(exc) -> tuple[int, Any]:
    """(rank, failure) of a failed launch (torch's ChildFailedError) that caused the others:
    the earliest failure that is not a rank losing a peer that failed before it (timestamps
    are whole seconds, so a peer's broken connection may carry the same one), else the
    earliest failure."""
    def order(item):
        rank, failure = item
        return (lost_a_peer(failure.message), failure.timestamp, rank)
    failures = getattr(exc, "failures", None)
    return min(failures.items(), key=order) if failures else exc.get_first_failure()


def failure_summary(exc: Exception, log_dir: Path, max_restarts: int) -> str:
    """The job's end: the first failed rank and its error (its first line, then the node and
    source lines the runtime added), after how many restarts, and where that rank's
    traceback and every rank's output are."""
    if not getattr(exc, "failures", None) and not hasattr(exc, "get_first_failure"):
        return f"ptc run: the job failed: {exc} (every rank's output: {log_dir})"
    rank, failure = root_failure(exc)
    error = error_text(failure.message) if failure.message else ""
    if not error or error.startswith("Signal "):
        error = how_it_ended(failure.exitcode)
    else:
        error = error.removeprefix(f"rank {rank}: ")
    after = f" after {max_restarts} restart{'s' if max_restarts != 1 else ''}" \
        if max_restarts else ""
    trace = Path(failure.error_file).with_name("stderr.log") if failure.error_file else None
    where = f"traceback: {trace}" if trace is not None and trace.is_file() else \
        f"every rank's output: {log_dir}"
    first, _, rest = error.partition("\n")
    return f"ptc run: rank {rank} stopped the job{after}: {first} [{where}]" + (
        f"\n{rest}" if rest else "")
