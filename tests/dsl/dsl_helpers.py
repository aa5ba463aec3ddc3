"""Shared helpers of the DSL tests: a small valid plan and ways to break it."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repo root on the path
    sys.path.insert(0, str(ROOT))

from ptc.dsl import parse  # noqa: E402
from ptc.errors import Diagnostic, PlanError  # noqa: E402

EXAMPLES = sorted((ROOT / "examples").glob("*.ptc"))

# Line numbers below are part of the golden tests: edit with care.
BASE = """\
# golden base plan
model llama {
  layers = 8
  hidden = 256
  heads = 8
  kv_heads = 4
  ffn = 688
  vocab = 1000
  max_seq = 512
}

hardware {
  gpu = "H100-SXM"
  nodes = 1
  gpus_per_node = 8
}

parallel {
  tp = 2
  pp = 2
  dp = 2
  zero = 1
  schedule = 1f1b
  checkpoint = selective
}

train {
  seq_len = 512
  global_batch = 16
  micro_batch = 1
  dtype = bf16
  steps = 10
  optimizer = adamw(lr = 3e-4)
}

runtime {
  checkpoint_dir = "ckpt"
  nan_policy = rollback
}
"""


def edit(*pairs: str, text: str = BASE) -> str:
    """`text` with each (old, new) pair replaced; every old must occur exactly once."""
    assert len(pairs) % 2 == 0
    for old, new in zip(pairs[::2], pairs[1::2]):
        assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times"
        text = text.replace(old, new)
    return text


def errors(text: str, file: str = "plan.ptc") -> tuple[Diagnostic, ...]:
    """The diagnostics of an invalid plan (fails the test if the plan is valid)."""
    try:
        parse(text, file)
    except PlanError as exc:
        return exc.diagnostics
    raise AssertionError("plan unexpectedly valid")


def find(diagnostics: tuple[Diagnostic, ...], needle: str) -> Diagnostic:
    """The one diagnostic whose message contains `needle`."""
    hits = [d for d in diagnostics if needle in d.message]
    assert len(hits) == 1, f"{needle!r} in {[d.message for d in diagnostics]}"
    return hits[0]
