"""The small dead ends of a first hour with ckptkit (issue 20): each answered cleanly."""

from __future__ import annotations

import subprocess
import sys

from helpers import FIXTURE_DIR


def test_ckptkit_alone_prints_its_help_not_an_error():
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkit"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("Usage: ckptkit [OPTIONS] COMMAND [ARGS]...")
    assert "Error" not in proc.stderr and "convert" in proc.stderr


def test_dir_lists_the_lazy_api():
    import ckptkit

    names = dir(ckptkit)
    assert {"convert", "train", "open_source", "load_into", "scan", "__version__"} <= set(names)


def test_strip_module_on_unwrapped_keys_is_a_no_op_with_a_note(run, tmp_path):
    result = run(
        "convert", FIXTURE_DIR / "single.pt", tmp_path / "out.safetensors", "--strip-module"
    )
    assert result.exit_code == 0, result.output
    assert (
        "Keys     9 tensors, 468 B: no key starts with 'module.' (saved unwrapped): none to strip"
        in result.stdout
    )
    # Keys wrapped by something else still fail, naming the chain.
    result = run(
        "convert", FIXTURE_DIR / "compiled.pt", tmp_path / "c.safetensors", "--strip-module"
    )
    assert result.exit_code != 0 and "--strip-wrappers removes the whole chain" in result.output


def test_convert_makes_the_missing_folders_of_its_output(run, tmp_path):
    result = run("convert", FIXTURE_DIR / "single.pt", tmp_path / "new" / "sub" / "m.safetensors")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "new" / "sub" / "m.safetensors").is_file()


def test_a_failed_convert_leaves_no_folder_behind(run, tmp_path, corrupt_head_bias_copy):
    result = run("convert", FIXTURE_DIR / "single.pt", tmp_path / "new" / "sub" / "m.safetensors")
    assert result.exit_code != 0 and "differs from the source" in result.output
    assert not (tmp_path / "new").exists()
