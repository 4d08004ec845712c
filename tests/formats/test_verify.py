"""Read-back verification refuses an output that disagrees with the plan, and an existing output
folder is never replaced without --force.

The disagreement is made at read-back: the reader that reads the written output (DCPSource for a
DCP folder, TorchFileSource for a .pt) is made to report other ties or other metadata than were
written, as a writer bug would make them. convert must then refuse with a VerificationError (one
``Error:`` line from the CLI) and leave nothing behind.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import FIXTURE_DIR
from safetensors.torch import save_file

import ckptkit
from ckptkit.errors import VerificationError
from ckptkit.formats.files.torchfile import TorchFileSource
from ckptkit.formats.folders.dcp import DCPSource


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _one_error_line(result) -> str:
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


@pytest.fixture
def tied_pt(tmp_path):
    """tied.pt (head.weight is embed.weight), copied: the only file the tests start with."""
    path = tmp_path / "tied.pt"
    shutil.copy(FIXTURE_DIR / "tied.pt", path)
    with ckptkit.open_source(path) as source:  # the tie the plan carries into the output
        assert source.aliases() == {"head.weight": "embed.weight"}
    return path


def _read_back_ties(monkeypatch, reader, ties: dict[str, str]) -> list[Path]:
    """``reader`` reports ``ties`` for every file or folder but the inputs (what convert writes);
    returns the paths it was asked about, so a test can show the read-back happened."""
    real = reader.aliases
    asked: list[Path] = []

    def aliases(self):
        if Path(self.path).name in ("tied.pt", "source.safetensors"):
            return real(self)
        asked.append(Path(self.path))
        return dict(ties)

    monkeypatch.setattr(reader, "aliases", aliases)
    return asked


@pytest.mark.parametrize("ties", [{}, {"embed.weight": "head.weight"}], ids=["lost", "reversed"])
def test_dcp_ties_read_back_otherwise_are_refused(tmp_path, tied_pt, monkeypatch, run, ties):
    asked = _read_back_ties(monkeypatch, DCPSource, ties)
    with pytest.raises(VerificationError, match="ties read back from .*out differ"):
        ckptkit.convert(tied_pt, tmp_path / "out", to="dcp")
    assert asked  # the written folder was read back
    assert _files(tmp_path) == ["tied.pt"]  # no folder, no temp folder
    line = _one_error_line(run("convert", "tied.pt", "out", "--to", "dcp"))
    assert "ties read back from out differ" in line
    assert _files(tmp_path) == ["tied.pt"]


def test_pt_ties_read_back_otherwise_are_refused(tmp_path, monkeypatch, run):
    """A .pt output keeps a tie as one storage; read back without it, it is refused. The source
    is safetensors (save_model's form) so that only the output is read by TorchFileSource."""
    weight = torch.randn(10, 4)
    save_file(
        {"embed.weight": weight},
        tmp_path / "source.safetensors",
        metadata={"head.weight": "embed.weight"},
    )
    asked = _read_back_ties(monkeypatch, TorchFileSource, {})
    with pytest.raises(VerificationError, match="ties read back from .*out.pt differ"):
        ckptkit.convert(tmp_path / "source.safetensors", tmp_path / "out.pt")
    assert asked
    assert _files(tmp_path) == ["source.safetensors"]
    line = _one_error_line(run("convert", "source.safetensors", "out.pt"))
    assert "ties read back from out.pt differ" in line
    assert _files(tmp_path) == ["source.safetensors"]


def test_untied_tensors_read_back_as_tied_are_refused(tmp_path, monkeypatch):
    """Two equal tensors that are not tied: every byte compares equal, only the ties differ."""
    weight = torch.randn(10, 4)
    save_file({"a": weight, "b": weight.clone()}, tmp_path / "source.safetensors")
    _read_back_ties(monkeypatch, TorchFileSource, {"b": "a"})
    with pytest.raises(VerificationError, match="ties read back"):
        ckptkit.convert(tmp_path / "source.safetensors", tmp_path / "out.pt")
    _read_back_ties(monkeypatch, DCPSource, {"b": "a"})
    with pytest.raises(VerificationError, match="ties read back"):
        ckptkit.convert(tmp_path / "source.safetensors", tmp_path / "out", to="dcp")
    assert _files(tmp_path) == ["source.safetensors"]


def test_dcp_metadata_read_back_otherwise_is_refused(tmp_path, tied_pt, monkeypatch, run):
    real = DCPSource.__init__

    def init(self, folder, **options):
        real(self, folder, **options)
        self.metadata = {**self.metadata, "ckptkit.source": '"somewhere else"'}

    monkeypatch.setattr(DCPSource, "__init__", init)
    with pytest.raises(VerificationError, match="metadata read back from .*out differs"):
        ckptkit.convert(tied_pt, tmp_path / "out", to="dcp")
    assert _files(tmp_path) == ["tied.pt"]
    line = _one_error_line(run("convert", "tied.pt", "out", "--to", "dcp"))
    assert "metadata read back from out differs" in line
    assert _files(tmp_path) == ["tied.pt"]


def test_without_the_disagreement_the_same_conversions_pass(tmp_path, tied_pt):
    """The control: unpatched, every conversion above verifies."""
    assert ckptkit.convert(tied_pt, tmp_path / "out", to="dcp").verified
    save_file(
        {"embed.weight": torch.randn(10, 4)},
        tmp_path / "source.safetensors",
        metadata={"head.weight": "embed.weight"},
    )
    assert ckptkit.convert(tmp_path / "source.safetensors", tmp_path / "out.pt").verified


# --- an existing output folder -----------------------------------------------------------------


def test_an_existing_empty_folder_is_not_replaced_without_force(tmp_path, run):
    """Renaming a folder onto an empty one succeeds on POSIX, so only the check for an existing
    output keeps an empty out/ from being replaced."""
    out = tmp_path / "out"
    out.mkdir()
    before = out.stat()
    line = _one_error_line(run("convert", FIXTURE_DIR / "single.pt", "out", "--to", "dcp"))
    assert "out exists" in line and "--force" in line
    assert os.listdir(out) == []
    assert (out.stat().st_ino, out.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert _files(tmp_path) == ["out"]  # no temp folder left
    with pytest.raises(ckptkit.CkptkitError, match="exists"):
        ckptkit.convert(FIXTURE_DIR / "single.pt", out, to="dcp")
    assert os.listdir(out) == [] and out.stat().st_ino == before.st_ino
    forced = run("convert", FIXTURE_DIR / "single.pt", "out", "--to", "dcp", "--force")
    assert forced.exit_code == 0, forced.output
    assert {".metadata", "__0_0.distcp"} <= set(os.listdir(out))
    assert _files(tmp_path) == ["out", *(f"out/{name}" for name in sorted(os.listdir(out)))]
    expected = torch.load(FIXTURE_DIR / "single.pt", weights_only=True)
    back = ckptkit.load_state_dict(out)
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[k], v) for k, v in expected.items())
