"""ruff check and ruff format stay clean (ruff comes with the test extra)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from helpers import ROOT


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff_is_clean(args):
    ruff = shutil.which("ruff")
    assert ruff, "ruff is missing: install with `pip install -e .[test]`"
    proc = subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_mypy_is_clean(monkeypatch):
    """The package type-checks (mypy reads its settings from pyproject.toml)."""
    mypy = pytest.importorskip("mypy.api")
    monkeypatch.chdir(ROOT)
    out, err, status = mypy.run([])
    assert status == 0, out + err
