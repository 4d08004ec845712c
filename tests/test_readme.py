"""The README's `$ ckptkit ...` transcripts are what the commands print (on the fixtures)."""

from __future__ import annotations

import re
import shutil

from click.testing import CliRunner
from conftest import FIXTURE_DIR, ROOT

from ckptkit.cli import cli


def _transcripts() -> list[tuple[str, list[str]]]:
    out = []
    for block in re.findall(r"```\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            # train and the demo need a run folder; they are checked by the engine tests.
            if not line.startswith("$ ckptkit") or " train " in line or "demo-out" in line:
                continue
            expected = []
            for follow in lines[i + 1 :]:
                if follow.startswith("$ "):
                    break
                expected.append(follow)
            if "..." not in expected:  # an elided transcript
                out.append((line[2:], expected))
    return out


def test_readme_transcripts_match(tmp_path, monkeypatch):
    monkeypatch.delenv("CKPTKIT_DEBUG", raising=False)
    transcripts = _transcripts()
    assert len(transcripts) >= 6
    for n, (command, expected) in enumerate(transcripts):
        folder = tmp_path / str(n)  # each transcript starts from the fixtures alone
        shutil.copytree(FIXTURE_DIR, folder, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
        monkeypatch.chdir(folder)
        result = CliRunner().invoke(cli, command.split()[1:], prog_name="ckptkit")
        assert (result.stdout + result.stderr).splitlines() == expected, command
