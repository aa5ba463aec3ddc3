"""What every test directory finds on the import path.

Test files are imported by their own folder (pytest's default "prepend" mode, no
`__init__.py`), so a test outside tests/distributed would not find the shared helpers
there — the tiny plans, the eager reference and the workers (`dist_helpers`) — nor the
repository root that `tests.tolerances` and `tests.user_models` are imported from.
Both go on `sys.path` here, once, before any test module is collected; processes that
the tests spawn inherit the path.

CPU plans are priced with the cpu preset's figures, the same on any machine:
PTC_HOST_PROFILE=off keeps `ptc run` from measuring this host for them
(`ptc.runtime.host_profile`, tested in tests/runtime/test_host_profile.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("PTC_HOST_PROFILE", "off")

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT / "tests" / "distributed", ROOT):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
