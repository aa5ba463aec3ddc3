"""The stall watchdog's verdict and its view of the main thread (`ptc.runtime.watchdog`).

The whole path (a rank hung in `ptc run`, noticed, named and restarted) is shown in
tests/distributed/test_faults.py; here each verdict it can reach, from the reports alone.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from ptc.runtime.watchdog import main_thread_at, stall_verdict

ROOT = Path(__file__).resolve().parents[2]


def test_the_rank_not_in_a_collective_is_named_as_the_one_that_stalled():
    reports = {0: (6, "ptc/ops/comm.py:154 in wait", True),
               1: (6, "ptc/runtime/data.py:80 in batch", False),
               2: (6, "ptc/ops/comm.py:154 in wait", True)}
    assert stall_verdict(reports, 3, 12.4) == (
        "step 6: no progress for 12 s; rank 1 stalled in step 6 at ptc/runtime/data.py:80 in "
        "batch; rank(s) 0, 2 wait(s) in a collective (ptc/ops/comm.py:154 in wait)")


def test_a_rank_that_does_not_report_is_hung_in_native_code_or_dead():
    reports = {0: (3, "ptc/ops/comm.py:154 in wait", True)}
    assert stall_verdict(reports, 2, 10.0) == (
        "step 3: no progress for 10 s; rank(s) 1 did not answer (hung in native code, or "
        "dead); rank(s) 0 wait(s) in a collective (ptc/ops/comm.py:154 in wait)")


def test_every_rank_in_a_collective_is_a_deadlock():
    reports = {r: (2, "ptc/ops/comm.py:154 in wait", True) for r in range(2)}
    verdict = stall_verdict(reports, 2, 10.0)
    assert "every rank waits in a collective: a deadlock" in verdict


def test_the_main_thread_is_seen_from_another_thread():
    seen = []
    worker = threading.Thread(target=lambda: seen.append(main_thread_at()))
    worker.start()
    time.sleep(0.05)  # the main thread sleeps here, in this test file: outside ptc
    worker.join()
    assert seen == [("outside ptc", False)]


def test_hang_timeout_reads_as_a_time_auto_or_none_and_writes_back():
    import ptc
    from ptc.dsl import dump_plan

    base = (ROOT / "examples" / "tiny_gpt_cpu.ptc").read_text()
    for text, value in (("2 min", 120.0), ("auto", "auto"), ("none", None)):
        plan = ptc.parse_plan(base.replace("runtime {", f"runtime {{\n  hang_timeout = {text}"))
        assert plan.runtime.hang_timeout == value
        assert ptc.parse_plan(dump_plan(plan)) == plan
    assert ptc.parse_plan(base).runtime.hang_timeout == "auto"
