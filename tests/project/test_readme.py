"""The `$ ckptkit ...` transcripts of README.md and docs/ are what the commands print (on the
fixtures), and the pages' relative links lead somewhere."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import servers
from click.testing import CliRunner
from helpers import FIXTURE_DIR, ROOT, free_port

from ckptkit.cli import cli

s3_server, s3, s3_env = servers.s3_server, servers.s3, servers.s3_env

README = ROOT / "README.md"
# What an `s3://ckpts/` transcript finds in the bucket (docs/remote.md): these fixtures.
BUCKET, IN_BUCKET = "ckpts", ("ddp.pt", "malicious.pt", "single.safetensors")
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]


def _blocks(text: str) -> list[list[str]]:
    """A page's fenced blocks that name no language, dedented (a list item indents its own)."""
    blocks: list[list[str]] = []
    lines: list[str] = []
    fence, indent = None, 0
    for line in text.splitlines():
        stripped = line.strip()
        if fence is None:
            if stripped.startswith("```"):
                fence, lines, indent = stripped[3:], [], len(line) - len(line.lstrip())
        elif stripped == "```":
            if fence == "":  # ```python and the like hold code, not transcripts
                blocks.append(lines)
            fence = None
        else:
            lines.append(line[indent:])
    return blocks


def _run_folders(text: str) -> list[str]:
    """The run folders a page's commands read: the demo's, and each `ckptkit train --out`."""
    return ["demo-out", *re.findall(r"ckptkit train [^`\n]*?--out ([\w./:-]+)", text)]


def _needs_a_run(command: str, folders: list[str]) -> bool:
    # train and what reads its run folder are checked by the engine tests.
    args = command.split()
    return args[1] == "train" or any(a == f or a.startswith(f + "/") for a in args for f in folders)


def transcripts(page: Path) -> list[tuple[str, list[str]]]:
    """Every `$ ckptkit ...` line of a page with the lines it printed, but for the ones that
    need a training run and the elided ones (a `...` line)."""
    text = page.read_text()
    folders = _run_folders(text)
    out = []
    for lines in _blocks(text):
        for i, line in enumerate(lines):
            if not line.startswith("$ ckptkit ") or _needs_a_run(line[2:], folders):
                continue
            expected = []
            for follow in lines[i + 1 :]:
                if follow.startswith("$ "):
                    break
                expected.append(follow)
            if "..." not in expected:  # an elided transcript
                out.append((line[2:], expected))
    return out


CASES = [(page, command, expected) for page in PAGES for command, expected in transcripts(page)]


def test_transcripts_are_found():
    # A floor, so that a change in how pages are written cannot check nothing in silence.
    assert len(transcripts(README)) >= 5
    assert len(CASES) >= 18  # as many as the README held before docs/ took most of them


@pytest.mark.parametrize(
    ("page", "command", "expected"),
    CASES,
    ids=[f"{page.relative_to(ROOT)}: {command}" for page, command, _ in CASES],
)
def test_transcript_matches(page, command, expected, tmp_path, monkeypatch, request):
    monkeypatch.delenv("CKPTKIT_DEBUG", raising=False)
    folder = tmp_path / "fixtures"  # each transcript starts from the fixtures alone
    shutil.copytree(FIXTURE_DIR, folder, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.chdir(folder)
    if f"s3://{BUCKET}/" in command:  # against moto's S3 server on 127.0.0.1, the bucket filled
        bucket = request.getfixturevalue("s3_env").bucket(BUCKET)
        for name in IN_BUCKET:
            request.getfixturevalue("s3_env").fs.put(str(folder / name), f"{bucket}/{name}")
    result = CliRunner().invoke(cli, command.split()[1:], prog_name="ckptkit")
    assert (result.stdout + result.stderr).splitlines() == expected, command


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    headings = re.findall(r"^#+ (.*)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_links_lead_somewhere(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links in code are not links
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        name, _, anchor = target.partition("#")
        path = (page.parent / name).resolve() if name else page
        assert path.exists(), f"{page.relative_to(ROOT)} links to {target}, which is missing"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), (
                f"{page.relative_to(ROOT)} links to {target}: no such heading"
            )


def test_every_docs_page_is_in_the_index():
    index = (ROOT / "docs" / "README.md").read_text()
    for page in PAGES:
        if page.parent != ROOT and page.name != "README.md":
            assert f"({page.relative_to(ROOT / 'docs').as_posix()})" in index, page


def _console_commands(page: Path, marker: str) -> list[str]:
    """The ``$ `` lines of a page's ```console blocks that mention ``marker``."""
    blocks = re.findall(r"```console\n(.*?)```", page.read_text(), flags=re.S)
    return [
        line[2:]
        for block in blocks
        if marker in block
        for line in block.splitlines()
        if line.startswith("$ ")
    ]


@pytest.mark.slow
def test_the_readme_s3_workflow_runs_as_printed(s3_env, tmp_path):
    """README's run trained into a bucket and converted from it by two processes, each line
    run as printed (the commands as a user types them, in subprocesses) against moto on
    127.0.0.1; the sharded output equals the run's latest weights."""
    import os
    import shlex
    import subprocess

    import ckptkit

    commands = _console_commands(README, "s3://ckpts/run")
    assert [c.split()[0] for c in commands] == ["ckptkit", "torchrun", "ckptkit"], commands
    s3_env.bucket("ckpts")
    # torchrun's --master-port (PET_MASTER_PORT) free, not 29500: the line itself runs as printed
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PET_MASTER_PORT": str(free_port())}
    for command in commands:
        done = subprocess.run(
            shlex.split(command),
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, (command, done.stdout, done.stderr)
    assert "sharded" in done.stdout  # the last line inspects the output
    assert ckptkit.diff("s3://ckpts/model.safetensors.index.json", "s3://ckpts/run").equal
