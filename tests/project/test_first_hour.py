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


def test_a_missing_file_is_a_file_not_found_error_and_a_format_error(tmp_path, run):
    import json

    import pytest

    import ckptkit
    from ckptkit.errors import FormatError

    missing = tmp_path / "nope.pt"
    for call in (ckptkit.load_state_dict, ckptkit.summarize, ckptkit.open_source):
        with pytest.raises(FileNotFoundError) as caught:
            call(missing)
        assert isinstance(caught.value, FormatError) and caught.value.filename == str(missing)
        assert str(caught.value) == f"{missing} does not exist; check the path"
    result = run("inspect", missing, "--json")
    assert result.exit_code == 1
    assert result.stderr == f"Error: {missing} does not exist; check the path\n"
    assert json.loads(result.stdout)["error"]["type"] == "MissingFileError"


def test_str_of_a_report_is_what_the_command_prints(run, tmp_path):
    import ckptkit

    src = FIXTURE_DIR / "ddp.pt"
    assert str(ckptkit.summarize(src)) == run("inspect", src).stdout.rstrip("\n")
    assert str(ckptkit.diff(src, FIXTURE_DIR / "single.pt")) == run(
        "diff", src, FIXTURE_DIR / "single.pt"
    ).stdout.rstrip("\n")
    report = ckptkit.convert(src, tmp_path / "a.safetensors", strip_module=True)
    printed = run("convert", src, tmp_path / "b.safetensors", "--strip-module").stdout
    assert str(report).replace("a.safetensors", "b.safetensors") == printed.rstrip("\n")


def _save(path, tensors):
    from safetensors.torch import save_file

    save_file(tensors, str(path))


def test_diff_says_a_dtype_change_once_and_how_many_differences_it_cut(run, tmp_path):
    import torch

    a = {f"w{i:02d}": torch.arange(16, dtype=torch.float32).reshape(4, 4) + i for i in range(16)}
    _save(tmp_path / "a.safetensors", a)
    _save(tmp_path / "b.safetensors", {k: v.to(torch.bfloat16) for k, v in a.items()})
    lines = run("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors").stdout.splitlines()
    assert [line for line in lines if line.startswith("dtype")] == [
        "dtype        16 tensors: float32 vs bfloat16 (values compared in the wider type)"
    ]
    c = {k: v + (1 if k != "w15" else 0) for k, v in a.items()}  # 15 of 16 differ
    _save(tmp_path / "c.safetensors", c)
    lines = run("diff", tmp_path / "a.safetensors", tmp_path / "c.safetensors").stdout.splitlines()
    assert "values       1 bit-equal, 0 within tolerance, 15 different" in lines
    assert sum(line.startswith("  w") for line in lines) == 10
    assert "  ... and 5 more (--json lists all)" in lines


def test_a_pt_report_says_the_extras_are_not_written(run, tmp_path):
    result = run("convert", FIXTURE_DIR / "training.pt", tmp_path / "o.pt")
    assert result.exit_code == 0, result.output
    assert (
        "Omitted  args, epoch, scheduler, step: not written (a .pt output holds only the state "
        "dict; .safetensors keeps them in its metadata)"
    ) in result.stdout.splitlines()


def test_inspect_counts_one_tensor_in_the_singular(run, tmp_path):
    import torch

    torch.save({"model": {"w": torch.ones(2)}, "rng": torch.zeros(3)}, tmp_path / "c.pt")
    lines = run("inspect", tmp_path / "c.pt").stdout.splitlines()
    assert "also        rng: 1 tensor, 12 B (not weights)" in lines
    assert "w  [2] f32  8 B" in lines
