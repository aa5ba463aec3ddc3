"""Relative paths written in a plan resolve against its folder; overrides against the shell's."""

from __future__ import annotations

from pathlib import Path

from ptc.dsl import load_plan

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_gpt_cpu.ptc"


def _plan_in(folder: Path) -> Path:
    text = TINY.read_text()
    text = text[:text.index("runtime {")] + (
        'runtime {\n  checkpoint_dir = "ckpt/run"\n  metrics = "/abs/m.jsonl"\n}\n')
    text = text.replace("data = synthetic(seed = 1234)", 'data = tokens("data/train.bin")')
    text = text.replace("init = random(seed = 0)", 'init = state_dict("../w.pt")')
    folder.mkdir(parents=True)
    (folder / "plan.ptc").write_text(text)
    return folder / "plan.ptc"


def test_paths_in_the_file_are_read_from_the_plans_folder(tmp_path: Path) -> None:
    plan = load_plan(_plan_in(tmp_path / "runs"))
    assert plan.train.data.path == str(tmp_path / "runs" / "data" / "train.bin")
    assert plan.train.init.path == str(tmp_path / "w.pt")
    assert plan.runtime.checkpoint_dir == str(tmp_path / "runs" / "ckpt" / "run")
    assert plan.runtime.metrics == "/abs/m.jsonl"  # absolute: as written


def test_a_path_given_on_the_command_line_stays_relative_to_the_working_directory(
        tmp_path: Path) -> None:
    plan = load_plan(_plan_in(tmp_path / "runs"), overrides={"runtime.checkpoint_dir": "c2",
                                                             "train.data": 'tokens("t.bin")'})
    assert (plan.runtime.checkpoint_dir, plan.train.data.path) == ("c2", "t.bin")
    assert plan.train.init.path == str(tmp_path / "w.pt")
