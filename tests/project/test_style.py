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


DOCS = sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md")])


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_fence_of_the_docs_is_a_line_of_its_own(page):
    """A fence followed by text on its line (```` ``` more text ````) is no closing fence: the
    rest of the page renders inverted."""
    fences = [
        (number, line)
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if line.lstrip().startswith("```")
    ]
    for number, line in fences:
        rest = line.strip()[3:]
        assert rest == "" or rest.isidentifier(), f"{page.name}:{number}: {line}"
    assert len(fences) % 2 == 0, f"{page.name}: a fence is left open"
