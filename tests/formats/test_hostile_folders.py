"""Folders whose files are not what their names promise: a FIFO where the weights should be, a
model folder whose weights are a pickle that runs code. Every command ends (no read blocks) and
says what it found, as it does for the file given alone."""

from __future__ import annotations

import os
import shutil

import pytest
from click.testing import CliRunner
from helpers import FIXTURE_DIR, one_error

from ckptkit.cli import cli

COMMANDS = {
    "inspect": [],
    "inspect --stats": [],
    "convert": ["out.safetensors"],
    "diff": [str(FIXTURE_DIR / "single.pt")],
}


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], prog_name="ckptkit")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_a_fifo_where_a_folder_s_weights_should_be_is_refused_unopened(
    tmp_path, monkeypatch, command, name
):
    """Opening a FIFO blocks until a writer comes: it is refused by name, never opened."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    os.mkfifo(folder / name)
    words = command.split()
    result = invoke(words[0], folder, *words[1:], *COMMANDS[command])
    one_error(result, f"{folder / name} is a FIFO, not a regular file")
    assert not (tmp_path / "out.safetensors").exists()


@pytest.fixture
def hostile_model_folder(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    shutil.copyfile(FIXTURE_DIR / "malicious.pt", folder / "pytorch_model.bin")
    return folder


def test_inspect_describes_a_model_folder_s_hostile_pickle_as_it_does_the_file(
    hostile_model_folder, tmp_path, monkeypatch
):
    """docs/security.md: inspect describes what a dangerous pickle would run, without running
    it; the folder is no exception (it was refused)."""
    monkeypatch.chdir(tmp_path)
    result = invoke("inspect", hostile_model_folder)
    assert result.exit_code == 0, result.output
    assert "builtins.exec" in result.output and "dangerous" in result.output
    assert "state dict  'model' (pytorch_model.bin of the folder)" in result.output
    assert not (tmp_path / "ckptkit_pwned").exists()
    alone = invoke("inspect", hostile_model_folder / "pytorch_model.bin")
    assert alone.exit_code == 0 and "builtins.exec" in alone.output


def test_convert_of_a_model_folder_s_hostile_pickle_is_still_refused(
    hostile_model_folder, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    result = invoke("convert", hostile_model_folder, tmp_path / "out.safetensors")
    one_error(result, "builtins.exec", "--trust")
    assert not (tmp_path / "out.safetensors").exists()
    assert not (tmp_path / "ckptkit_pwned").exists()
