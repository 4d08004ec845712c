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


def _train(out, **options):
    from ckptkit.engine import TrainConfig, train

    return train(TrainConfig(out=str(out), quiet=True, timeout_s=30.0, **options))


def test_a_run_is_never_silently_restarted(tmp_path, run):
    import pytest

    from ckptkit.errors import UsageError

    out = tmp_path / "r"
    _train(out, epochs=3, keep_last=0)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(UsageError, match="holds an earlier run"):
        _train(out, epochs=1)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing touched
    result = run("train", "--epochs", "1", "--out", out, "-q")
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"Error: --out {out} holds an earlier run (ckpt-epoch0001.pt, ckpt-epoch0002.pt, "
        "ckpt-epoch0003.pt, latest, ...); resume it with --resume auto (or --resume PATH), "
        "or pass --overwrite to delete its checkpoints and logs and start afresh"
    )
    with pytest.raises(UsageError, match="--resume and --overwrite contradict"):
        _train(out, epochs=4, resume="auto", overwrite=True)


def test_overwrite_clears_the_earlier_runs_checkpoints_and_logs(tmp_path):
    out = tmp_path / "r"
    _train(out, epochs=3, keep_last=0)
    (out / "notes.txt").write_text("mine")
    _train(out, epochs=1, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [
        "ckpt-epoch0001.pt",
        "latest",
        "metrics.jsonl",
        "notes.txt",  # not the run's: kept
        "steps.jsonl",
    ]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_a_launched_run_is_refused_before_any_worker_starts(tmp_path):
    import pytest

    from ckptkit.errors import UsageError

    out = tmp_path / "r"
    _train(out, epochs=1)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(UsageError, match="holds an earlier run"):  # raised here, not by a rank
        _train(out, mode="ddp", epochs=1, nproc_per_node=2)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
