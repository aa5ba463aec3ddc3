"""The README's Python snippets run as written, pasted into a script."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SNIPPETS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def test_the_readme_has_its_python_snippets():
    assert len(SNIPPETS) >= 2 and all("ptc.run(" in s for s in SNIPPETS[:2])


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_a_readme_snippet_runs_as_written(index, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(SNIPPETS[index])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "freeze_support" not in done.stderr
