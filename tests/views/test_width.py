"""Every view `ptc` prints fits an 80-column terminal, and nothing in it is cut.

`ptc explain`, `ptc plan`, `ptc inspect` (code and table) and the model
summary `ptc compile` prints, for each example plan and a few overrides,
printed at 80 columns (as `COLUMNS=80` sets them) by a console that wraps as
the command line's does: no line is wider than 80, nothing is cut to "…",
and every number printed wide is printed whole at 80 (a number folded over
two lines would show as two others).
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

from ptc import cli
from ptc.views.inspect import render_graph
from ptc.views.summary import render_summary, summarize
from ptc.dsl import load_plan
from ptc.lower.driver import compile_plan

pytestmark = pytest.mark.timeout(300)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
WIDTH = 80

PLANS = [
    ("llama70b_h100x64_dp64", ()),
    ("llama70b_h100x64_tp8_pp4_dp2", ()),
    ("llama70b_h100x64_tp8_pp8_dp1", ()),
    ("llama70b_h100x64_zero3_dp64", ()),
    ("llama7b_h100x8", ()),
    ("llama7b_h100x8", ("--train.dtype", "fp8")),
    ("llama7b_h100x8", ("--parallel.grad_comm", "fp8")),
    ("tiny_gpt_cpu", ()),
    ("tiny_gpt_cpu", ("--parallel.tp", "2", "--parallel.dp", "4")),
]
IDS = [" ".join((name, *flags)) for name, flags in PLANS]

NUMBER = re.compile(r"\d[\d,.]*")


@pytest.fixture
def console(monkeypatch):
    """Make the command line print into a buffer at a width (wrapping as its own console
    does); return that buffer."""
    def printed(width: int) -> io.StringIO:
        out = io.StringIO()
        monkeypatch.setattr(cli, "_out", Console(file=out, width=width, highlight=False,
                                                 soft_wrap=cli._out.soft_wrap))
        return out
    return printed


def ptc(console, *args: str) -> tuple[str, str]:
    """What `ptc ARGS` prints on stdout at WIDTH columns and at 1000.

    Run once: what it prints is printed again at 1000 columns (a rich renderable lays
    itself out at the width it is printed at, as the command line's console does)."""
    out = console(WIDTH)
    prints = []
    print_narrow = cli._out.print

    def print_and_keep(*objects, **kwargs):
        prints.append((objects, kwargs))
        print_narrow(*objects, **kwargs)

    cli._out.print = print_and_keep
    cli.main(list(args))  # exit 1 for a plan that does not fit: explained all the same
    wide = console(1000)
    for objects, kwargs in prints:
        cli._out.print(*objects, **kwargs)
    return out.getvalue(), wide.getvalue()


def assert_fits(narrow: str, wide: str) -> None:
    """`narrow` fits WIDTH, cuts nothing and shows each number `wide` shows, whole."""
    assert narrow.strip() and wide.strip()
    lines = narrow.splitlines()
    too_wide = [line for line in lines if len(line) > WIDTH]
    assert not too_wide, f"{len(too_wide)} lines over {WIDTH}:\n" + "\n".join(too_wide)
    assert "…" not in narrow
    assert set(NUMBER.findall(narrow)) == set(NUMBER.findall(wide))


@pytest.mark.parametrize("name,flags", PLANS, ids=IDS)
def test_explain_fits_80_columns(console, name, flags):
    args = ("explain", str(EXAMPLES / f"{name}.ptc"), *flags)
    narrow, wide = ptc(console, *args)
    assert "Where the step time goes" in narrow
    assert_fits(narrow, wide)


# `ptc plan` refuses grad_comm: its search tries ZeRO-3 layouts, which cannot carry it.
@pytest.mark.parametrize("name,flags", [p for p in PLANS if "--parallel.grad_comm" not in p[1]],
                         ids=[i for i in IDS if "grad_comm" not in i])
def test_plan_fits_80_columns(console, name, flags):
    args = ("plan", str(EXAMPLES / f"{name}.ptc"), *flags)
    narrow, wide = ptc(console, *args)
    assert "Fastest layouts" in narrow
    assert_fits(narrow, wide)


@pytest.mark.parametrize("name,flags", PLANS, ids=IDS)
def test_compile_summary_and_inspect_fit_80_columns(console, name, flags):
    """The summary `ptc compile` prints at capture, and `ptc inspect`'s code and table of
    the first and last stage."""
    overrides = dict(zip((flag.removeprefix("--") for flag in flags[::2]), flags[1::2]))
    captured = []
    program = compile_plan(load_plan(EXAMPLES / f"{name}.ptc", overrides=overrides),
                           on_capture=captured.append)
    summary = render_summary(summarize(captured[0]))
    printed = []
    for width in (WIDTH, 1000):
        out = console(width)
        cli._out.print(summary)
        printed.append(out.getvalue())
    assert_fits(*printed)
    for stage in sorted({0, len(program.stages) - 1}):
        for fmt in ("code", "table"):
            assert_fits(render_graph(program, stage, fmt, width=WIDTH),
                        render_graph(program, stage, fmt, width=1000))
