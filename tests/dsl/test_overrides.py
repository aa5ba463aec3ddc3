"""Command-line overrides `--section.key value`: read by the plan language, reported by flag.

An override sets a key as if its line stood in the file's section (adding
the section when the file has none), the whole plan is checked together, and
a problem with an override names its flag and the valid choices instead of
a file position. The same overrides reach `ptc run`'s workers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ptc.cli import main
from ptc.dsl import load_plan
from ptc.dsl.overrides import split_overrides
from ptc.errors import PlanError
from ptc.runtime.launcher import launcher_args

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny_gpt_cpu.ptc"


def test_values_are_read_as_plan_text():
    plan = load_plan(TINY, overrides={"parallel.dp": "4", "hardware.gpus_per_node": "4",
                                      "parallel.schedule": "gpipe",
                                      "train.optimizer": "adamw(lr = 3e-4)",
                                      "train.steps": 7})
    assert (plan.parallel.dp, plan.hardware.gpus_per_node, plan.train.steps) == (4, 4, 7)
    assert plan.parallel.schedule == "gpipe" and plan.train.optimizer.lr == 3e-4


def test_a_path_needs_no_quotes_and_a_missing_section_is_added(tmp_path):
    text = TINY.read_text()
    bare = tmp_path / "no_runtime.ptc"
    bare.write_text(text[:text.index("runtime {")])
    plan = load_plan(bare, overrides={"runtime.checkpoint_dir": "ckpt/run-1",
                                      "runtime.metrics": "m.jsonl"})
    assert (plan.runtime.checkpoint_dir, plan.runtime.metrics) == ("ckpt/run-1", "m.jsonl")


@pytest.mark.parametrize("overrides,message", [
    ({"parallel.tp": "3"}, r"--parallel.tp: error: heads\(4\) is not divisible by tp\(3\)\n"
                           r"    valid: 1, 2, 4"),
    ({"parallel.tpp": "2"}, r"--parallel.tpp: error: unknown key 'tpp' in parallel; did you "
                            r"mean 'tp'\?"),
    ({"train.dtype": "fp33"}, r"--train.dtype: error: dtype = fp33 is not a valid choice; did "
                              r"you mean 'fp32'\?\n    valid: fp32, bf16, fp16"),
    ({"trian.steps": "2"}, r"--trian.steps: error: no plan field 'trian.steps'"),
])
def test_a_bad_override_names_its_flag_and_what_is_valid(overrides, message):
    with pytest.raises(PlanError, match=message):
        load_plan(TINY, overrides=overrides)


def test_the_command_line_splits_overrides_from_flags():
    rest, overrides = split_overrides(["run", "p.ptc", "--parallel.tp", "4", "--nproc", "2",
                                       "--train.steps=100", "--rdzv-endpoint", "10.0.0.1:1"])
    assert rest == ["run", "p.ptc", "--nproc", "2", "--rdzv-endpoint", "10.0.0.1:1"]
    assert overrides == {"parallel.tp": "4", "train.steps": "100"}
    # The workers get none: they read the plan `ptc run` resolved (tests/runtime/test_launcher.py).
    assert launcher_args("resolved.ptc", 2)[-3:] == ["-m", "ptc.worker", "resolved.ptc"]


def test_dump_prints_the_resolved_plan(capsys):
    assert main(["dump", str(TINY), "--parallel.dp", "4", "--hardware.gpus_per_node", "4"]) == 0
    text = capsys.readouterr().out
    assert "  dp = 4\n" in text and "  gpus_per_node = 4\n" in text
    assert main(["check", str(TINY), "--parallel.tp", "3"]) == 1
    assert "--parallel.tp: error:" in capsys.readouterr().err
    assert main(["check", str(TINY), "--parallel.tp"]) == 2  # no value
