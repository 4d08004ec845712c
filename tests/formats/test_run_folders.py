"""ckptkit's own run folders (``train --out DIR``) are read by every command and the library:
``latest`` is followed, ``--select`` takes ``best`` or a checkpoint by name, and the report
says which checkpoint was taken."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptkit
from ckptkit.cli import cli
from ckptkit.engine import TrainConfig, train
from ckptkit.errors import FormatError, SelectError

FAST = {"quiet": True, "timeout_s": 30.0}
MODES = [
    "single",
    "dp",  # nn.DataParallel on the CPU: one process, its keys saved unwrapped
    pytest.param("ddp", marks=pytest.mark.slow),
    pytest.param("fsdp", marks=pytest.mark.slow),
]


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], prog_name="ckptkit")


@pytest.fixture(scope="module", params=MODES)
def run_folder(request, tmp_path_factory):
    """A 2-epoch run of each mode, with --monitor so that `best` exists."""
    mode = request.param
    out = tmp_path_factory.mktemp(mode) / "run"
    extra = {"nproc_per_node": 2} if mode in ("ddp", "fsdp") else {}
    train(TrainConfig(mode=mode, epochs=2, out=str(out), monitor="loss", **extra, **FAST))
    return out


def newest(run: Path) -> Path:
    return run / (run / "latest").read_text().strip()


def test_inspect_follows_latest_and_says_which(run_folder):
    result = invoke("inspect", run_folder)
    assert result.exit_code == 0, result.output
    latest = newest(run_folder).name
    assert f"{latest}, the run's latest checkpoint" in result.output
    assert "DeepSpeed" not in result.output
    summary = json.loads(invoke("inspect", run_folder, "--json").stdout)
    assert len(summary["tensors"]) == 6


def test_convert_and_load_give_the_latest_checkpoints_weights(run_folder, tmp_path):
    out = tmp_path / "model.safetensors"
    result = invoke("convert", run_folder, out)
    assert result.exit_code == 0, result.output
    from safetensors.torch import load_file

    written = load_file(out)
    straight = ckptkit.load_state_dict(newest(run_folder))
    assert written.keys() == straight.keys()
    assert all(torch.equal(written[k], straight[k]) for k in written)
    via_folder = ckptkit.load_state_dict(run_folder)
    assert all(torch.equal(via_folder[k], straight[k]) for k in straight)


def test_diff_of_the_folder_and_its_latest_is_equal(run_folder):
    result = invoke("diff", run_folder, newest(run_folder))
    assert result.exit_code == 0, result.output


def test_select_best_and_by_name(run_folder):
    first = sorted(p.name for p in run_folder.glob("ckpt-epoch0001*"))[0]
    stem = first.split(".")[0]
    result = invoke("inspect", run_folder, "--select", stem, "--json")
    assert result.exit_code == 0, result.output
    best = (run_folder / "best").read_text().strip()
    result = invoke("inspect", run_folder, "--select", "best")
    assert result.exit_code == 0 and f"{best}, the run's best checkpoint" in result.output
    a = ckptkit.load_state_dict(run_folder / first)
    with ckptkit.open_source(run_folder, select=stem) as source:
        assert source.selected_reason.endswith(f"{first}, chosen with --select")
        b = {k: source.load(k) for k in source.keys()}
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_scan_covers_every_checkpoint_of_the_run_and_finds_it_safe(run_folder):
    # ckptkit's own checkpoints of every mode scan safe: DCP's .metadata classes are data.
    result = invoke("scan", run_folder, "--json")
    assert result.exit_code == 0, result.output
    reports = json.loads(result.stdout)["files"]
    files = {Path(r["path"]).relative_to(run_folder).parts[0] for r in reports}
    assert {p.name for p in run_folder.glob("ckpt-epoch*")} <= files
    assert {r["verdict"] for r in reports} == {"safe"}


def test_a_missing_latest_checkpoint_and_an_unknown_name_are_refused(tmp_path):
    run = tmp_path / "run"
    train(TrainConfig(mode="single", epochs=2, out=str(run), **FAST))
    with pytest.raises(SelectError, match="no checkpoint 'ckpt-epoch0009'.*ckpt-epoch0001.pt"):
        ckptkit.open_source(run, select="ckpt-epoch0009")
    with pytest.raises(SelectError, match="has no 'best' checkpoint"):
        ckptkit.open_source(run, select="best")
    newest(run).unlink()
    result = invoke("inspect", run)
    assert result.exit_code != 0
    assert result.output.strip() == (
        f"Error: {run} is a ckptkit run whose latest checkpoint 'ckpt-epoch0002.pt' is missing; "
        "give one of its checkpoints to --select: ckpt-epoch0001.pt"
    )
    with pytest.raises(FormatError):
        ckptkit.load_state_dict(run)


@pytest.mark.parametrize("kind", ["run", "deepspeed"])
@pytest.mark.parametrize("command", ["inspect", "scan", "convert", "diff"])
def test_a_huge_latest_pointer_is_refused_unread(tmp_path, kind, command):
    """A 16 MiB ``latest`` is neither read whole nor quoted in the error: a pointer names a
    checkpoint, a line long."""
    from helpers import FIXTURE_DIR, one_error

    folder = tmp_path / kind
    folder.mkdir()
    if kind == "run":
        (folder / "ckpt-epoch0001.pt").write_bytes((FIXTURE_DIR / "single.pt").read_bytes())
    else:
        (folder / "global_step1").mkdir()
    (folder / "latest").write_bytes(b"ckpt-epoch0001.pt" * (1 << 20))
    args = {"convert": [tmp_path / "out.safetensors"], "diff": [FIXTURE_DIR / "single.pt"]}
    result = CliRunner().invoke(
        cli, [command, str(folder), *map(str, args.get(command, []))], prog_name="ckptkit"
    )
    line = one_error(result, str(folder / "latest"), "too large")
    assert len(line) < 300
    assert not (tmp_path / "out.safetensors").exists()
