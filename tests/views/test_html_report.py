"""`ptc report`: one self-contained HTML page, checked as text and as a browser shows it.

The page is rendered for a two-stage pipeline; its text must carry the
estimate's numbers and the pass log, and it must fetch nothing. Then headless
Chromium opens it and takes a screenshot, and the picture must show the
schedule: forward and backward cells in their colours, as many of one as of
the other (every micro-batch is forwarded and backwarded once on each rank),
and the memory bars drawn to their own scale (the budget's line where they
reach it); each graph node names itself on hover; a zero-bubble schedule's picture draws its input- and
weight-gradient cells in colours of their own. Without a Chromium on the machine that test is
skipped with the reason (CI installs one).
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ptc.cli import main
from ptc.compiler.schedule.build import build_schedule
from ptc.compiler.memory.model import TERMS
from ptc.compiler.search.estimate import estimate
from ptc.views.html_report import (BACKWARD, BUDGET, FORWARD, INPUT_GRADIENTS, PALETTE,
                                   WEIGHT_GRADIENTS, _gantt, _memory, render_report)
from ptc.dsl import load_plan
from ptc.lower.driver import compile_plan
from ptc.units import format_bytes, format_seconds

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_gpt_cpu.ptc"
PIPELINE = {"parallel.pp": 2, "parallel.dp": 4}
CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser",
                                                 "google-chrome"))), None)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("report") / "report.html"
    assert main(["report", str(TINY), "--parallel.pp", "2", "--parallel.dp", "4",
                 "-o", str(path)]) == 0
    return path


def test_the_page_carries_the_estimate_and_the_passes_and_fetches_nothing(page):
    text = page.read_text()
    program = compile_plan(load_plan(TINY, overrides=PIPELINE))
    est = program.decisions.estimate
    assert f"<td>{format_seconds(est.step_time_s)}</td>" in text
    assert f"{format_bytes(est.peak_memory_bytes)} of a {format_bytes(est.budget_bytes)}" in text
    # every pass's line, the pass named in words
    assert all(html.escape(line.partition(": ")[2]) in text for line in program.pass_log)
    assert "<b>Pipeline split</b> <small>(split_pipeline_pass)</small>" in text
    assert [m for m in ("schedule", "memory", "time", "stage0", "stage1")
            if f'id="{m}"' not in text] == []
    assert text.count("<svg") == 5
    assert not re.search(r'(src|href)="(https?:)?//', text)  # self-contained
    assert render_report(program) == text  # the command writes what the library renders


def _pixels(image: np.ndarray, colour: str) -> int:
    want = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)]) / 255
    return int((np.abs(image[..., :3] - want).max(axis=-1) < 0.02).sum())


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine to open the page in "
                                              "(CI installs one with apt-get)")
def test_headless_chromium_shows_the_schedule_and_the_budget(page, tmp_path):
    from matplotlib.image import imread

    shot = tmp_path / "report.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={shot}", "--window-size=1200,1300", page.as_uri()],
                   check=True, capture_output=True, timeout=120)
    image = imread(shot)
    forward, backward = _pixels(image, FORWARD), _pixels(image, BACKWARD)
    assert forward > 2000 and backward > 2000, (forward, backward)
    assert abs(forward - backward) < 0.1 * forward  # 8 forward and 8 backward cells
    # The memory bars fill their chart: a CPU rank's few hundred MiB against a 16 GiB budget
    # is drawn to its own scale, the budget named above it.
    assert _pixels(image, PALETTE[TERMS.index("buffers")]) > 2000


def test_the_budget_line_is_drawn_where_the_bars_reach_it(tmp_path):
    """A 70B plan on 64 H100s nearly fills its budget: the chart keeps the HBM and budget
    lines, the budget's dashed red one visible."""
    from matplotlib.image import imread

    est = estimate(load_plan(TINY.parent / "llama70b_h100x64_tp8_pp4_dp2.ptc"))
    assert est.peak_memory_bytes * 3 > est.budget_bytes
    _memory(est).savefig(tmp_path / "memory.png", dpi=100)
    assert _pixels(imread(tmp_path / "memory.png"), BUDGET) > 300


def test_each_graph_node_names_itself_on_hover(page):
    """Every node of each stage's picture carries its name, op and layer as an SVG title."""
    text = page.read_text()
    program = compile_plan(load_plan(TINY, overrides=PIPELINE))
    for stage, info in enumerate(program.stages):
        group = text[text.index(f'<g id="ptc-nodes-{stage}"'):]
        group = group[:group.index("</g>")]
        titles = re.findall(r"<title>([^<]*)</title>", group)
        assert len(titles) == len(info.graph.graph.nodes)
        assert any(t.endswith(", layer 0") or t.endswith(", layer 2") for t in titles)


def test_a_split_backward_draws_its_i_and_w_cells_in_their_own_colours(tmp_path):
    """Zero bubble: each micro-batch's F, I and W once on each rank, so as many cells of
    each colour, and none of the whole backward's."""
    from matplotlib.image import imread

    _gantt(build_schedule("zero_bubble", 2, 4)).savefig(tmp_path / "gantt.png", dpi=100)
    image = imread(tmp_path / "gantt.png")
    cells = [_pixels(image, c) for c in (FORWARD, INPUT_GRADIENTS, WEIGHT_GRADIENTS)]
    assert min(cells) > 500 and max(cells) < 1.1 * min(cells), cells
    assert _pixels(image, BACKWARD) == 0
