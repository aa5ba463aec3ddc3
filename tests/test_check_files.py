"""`ptc check` says which input files a plan names are missing, as warnings naming the field.

The plan itself is valid (exit 0): the files may appear before the run; but
`ptc run` would refuse it, so the check says so now rather than after launch.
"""

from __future__ import annotations

from pathlib import Path

from ptc.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny_gpt_cpu.ptc"


def test_missing_data_and_init_files_are_warned_about(tmp_path, capsys):
    assert main(["check", str(TINY), f"--train.data=tokens(\"{tmp_path / 'none.bin'}\")",
                 f"--train.init=hf(\"{tmp_path}\")"]) == 0
    err = capsys.readouterr().err
    assert f'warning: train.data: tokens("{tmp_path / "none.bin"}"): no such file' in err
    assert f'warning: train.init: hf("{tmp_path}"): no save_pretrained weights there' in err
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "none.bin").write_bytes(b"")
    assert main(["check", str(TINY), f"--train.data=tokens(\"{tmp_path / 'none.bin'}\")",
                 f"--train.init=hf(\"{tmp_path}\")"]) == 0
    assert "warning" not in capsys.readouterr().err
