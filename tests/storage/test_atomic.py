"""Writes that survive faults: a failing write on any output format gives one error line and
leaves nothing; temp files that killed runs left are removed by the next run (only ckptkit's,
only when their writer is gone); two converts racing for one new output never replace each
other's file; on a filesystem without hard links the output still appears by one rename that
never replaces a file."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import FIXTURE_DIR, ROOT
from safetensors.torch import load_file

import ckptkit
from ckptkit.errors import OutputError
from ckptkit.storage.atomic import _commit, atomic_outputs, remove_stale_temps

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _big_checkpoint(path, mb: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = mb * 1024 * 1024 // 4 // 8
    torch.save({f"w{i}": torch.randn(n, generator=gen) for i in range(8)}, path)


@pytest.mark.parametrize(
    "dst", ["out.pt", "out.safetensors", "shards/model.safetensors"], ids=["pt", "st", "sharded"]
)
def test_a_failing_write_gives_one_line_and_leaves_nothing(tmp_path, dst):
    src = tmp_path / "src.pt"
    _big_checkpoint(src, 8)
    (tmp_path / "shards").mkdir()
    # The file-size limit makes every write past 1 MB fail with EFBIG, as a full disk would.
    script = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
        "from ckptkit.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    args = ["convert", "src.pt", dst] + (["--max-shard-size", "3MB"] if "shards" in dst else [])
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.splitlines()
    folder = "shards/" if "shards" in dst else ""
    assert line.startswith(f"Error: cannot write {folder}") and line.endswith("File too large")
    left = sorted(p.name for p in tmp_path.rglob("*") if p.is_file() and p.name != "src.pt")
    assert left == []


def test_temps_of_a_killed_convert_are_removed_by_the_next_run(tmp_path):
    src = tmp_path / "src.pt"
    _big_checkpoint(src, 96)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptkit", "convert", "src.pt", "out.pt"],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    temps: list = []
    while not temps and time.monotonic() < deadline and proc.poll() is None:
        temps = [p for p in tmp_path.iterdir() if p.name.startswith(".out.pt.ckptkit-")]
        time.sleep(0.005)
    if not temps:
        proc.wait()
        pytest.skip("the convert finished before it could be killed")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert temps[0].exists() and not (tmp_path / "out.pt").exists()
    old = time.time() - 60
    os.utime(temps[0], (old, old))
    ckptkit.convert(FIXTURE_DIR / "single.pt", tmp_path / "other.safetensors")
    assert not temps[0].exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.safetensors", "src.pt"]


def test_only_ckptkit_temps_whose_writer_is_gone_are_removed(tmp_path):
    # A live writer: another process holding the lock on its temp file.
    live = tmp_path / ".a.pt.ckptkit-live.tmp"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(live)!r}, os.O_CREAT | os.O_RDWR)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        dead = tmp_path / ".a.pt.ckptkit-dead.tmp"
        dead.write_bytes(b"x")
        young = tmp_path / ".a.pt.ckptkit-young.tmp"
        young.write_bytes(b"x")
        foreign = tmp_path / ".a.pt.mine.tmp"
        foreign.write_bytes(b"x")
        old = time.time() - 60
        for path in (live, dead, foreign):
            os.utime(path, (old, old))
        assert remove_stale_temps(tmp_path) == [dead]
        assert live.exists() and young.exists() and foreign.exists()
    finally:
        holder.kill()
        holder.communicate()  # reaped, its pipe closed
    os.utime(live, (old, old))
    assert remove_stale_temps(tmp_path) == [live]  # its writer is gone now


def test_the_final_step_never_replaces_a_file_that_appeared(tmp_path):
    dst = tmp_path / "out.safetensors"
    with pytest.raises(OutputError, match="out.safetensors exists; pass force=True"):
        with atomic_outputs([dst]) as (tmp,):
            tmp.write_bytes(b"mine")
            dst.write_bytes(b"theirs")  # another writer finished first
    assert dst.read_bytes() == b"theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]
    tmp = tmp_path / "t"
    tmp.write_bytes(b"forced")
    _commit(tmp, dst, force=True)
    assert dst.read_bytes() == b"forced"


def test_a_half_placed_sharded_output_is_taken_back(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    with pytest.raises(OutputError, match="b exists"):
        with atomic_outputs([first, second]) as temps:
            for tmp in temps:
                tmp.write_bytes(b"mine")
            second.write_bytes(b"theirs")
    assert not first.exists() and second.read_bytes() == b"theirs"


def test_two_racing_converts_one_wins_the_other_says_exists(tmp_path):
    for i in (1, 2):
        _big_checkpoint(tmp_path / f"src{i}.pt", 16, seed=i)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ckptkit", "convert", f"src{i}.pt", "out.safetensors", "-q"],
            cwd=tmp_path,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (1, 2)
    ]
    said = [p.communicate()[1] for p in procs]  # each waited for, its pipes closed
    results = [(p.returncode, err) for p, err in zip(procs, said, strict=True)]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 1], results
    loser = next(err for code, err in results if code == 1)
    assert loser == "Error: out.safetensors exists; pass --force to overwrite it\n"
    winner = next(i for i, (code, _) in zip((1, 2), results, strict=True) if code == 0)
    report = ckptkit.diff(tmp_path / f"src{winner}.pt", tmp_path / "out.safetensors")
    assert report.equal
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors", "src1.pt", "src2.pt"]


# --- a filesystem without hard links ------------------------------------------------------------


@pytest.fixture(params=[errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK], ids=errno.errorcode.get)
def no_hard_links(request, monkeypatch):
    """os.link fails as it does where the filesystem has no hard links (FAT and exFAT say
    EPERM, some network and FUSE filesystems EOPNOTSUPP, a link-count limit EMLINK). Returns the
    links that were tried."""
    tried = []

    def link(src, dst, *args, **kwargs):
        tried.append((str(src), str(dst)))
        raise OSError(request.param, os.strerror(request.param), str(src), None, str(dst))

    monkeypatch.setattr(os, "link", link)
    return tried


def _commit_watching(dst, appear: bytes | None = None):
    """atomic_outputs([dst]) writing b"mine"; ``appear``: another writer's file that shows up
    at dst before the commit. Returns the temp file's inode and name."""
    with atomic_outputs([dst]) as (tmp,):
        tmp.write_bytes(b"mine")
        assert not dst.exists()  # nothing at the output until the commit
        inode = tmp.stat().st_ino
        if appear is not None:
            dst.write_bytes(appear)
    return inode, tmp


def test_without_hard_links_the_output_appears_by_one_rename(tmp_path, no_hard_links):
    dst = tmp_path / "out.safetensors"
    inode, tmp = _commit_watching(dst)
    assert no_hard_links == [(str(tmp), str(dst))]  # the link was tried, and failed
    assert dst.read_bytes() == b"mine"
    assert dst.stat().st_ino == inode  # the temp file itself, renamed: never a partial copy
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]  # no temp left


def test_without_hard_links_a_file_that_appeared_is_not_replaced(tmp_path, no_hard_links):
    dst = tmp_path / "out.safetensors"
    with pytest.raises(OutputError, match="out.safetensors exists"):
        _commit_watching(dst, appear=b"theirs")
    assert no_hard_links  # the fallback was what refused
    assert dst.read_bytes() == b"theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]
    with atomic_outputs([dst], force=True) as (tmp,):  # with force it is replaced
        tmp.write_bytes(b"forced")
    assert dst.read_bytes() == b"forced"


def test_without_hard_links_or_renameat2_the_check_still_refuses(
    tmp_path, no_hard_links, monkeypatch
):
    """A C library without renameat2 (older glibc, musl, macOS): the output still appears by
    one rename, and a file already there is still refused."""

    class LibcWithoutRenameat2:
        def __init__(self, *args, **kwargs):
            pass

    monkeypatch.setattr(ctypes, "CDLL", LibcWithoutRenameat2)
    dst = tmp_path / "out.safetensors"
    inode, _ = _commit_watching(dst)
    assert dst.read_bytes() == b"mine" and dst.stat().st_ino == inode
    other = tmp_path / "other.safetensors"
    with pytest.raises(OutputError, match="other.safetensors exists"):
        _commit_watching(other, appear=b"theirs")
    assert other.read_bytes() == b"theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.safetensors", "out.safetensors"]


def test_without_hard_links_convert_writes_and_refuses_as_usual(tmp_path, no_hard_links, run):
    result = run("convert", FIXTURE_DIR / "single.pt", "out.safetensors", "-q")
    assert result.exit_code == 0, result.output
    assert no_hard_links  # the fallback wrote it
    expected = torch.load(FIXTURE_DIR / "single.pt", weights_only=True)
    written = load_file(tmp_path / "out.safetensors")
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], v) for k, v in expected.items())
    before = (tmp_path / "out.safetensors").read_bytes()
    again = run("convert", FIXTURE_DIR / "single.pt", "out.safetensors", "--dtype", "bf16")
    assert again.exit_code == 1
    assert again.stderr == "Error: out.safetensors exists; pass --force to overwrite it\n"
    assert (tmp_path / "out.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]


_SIGNALLED_AS_MADE = """
import os, signal, sys, tempfile
from pathlib import Path
from ckptkit.storage.atomic import atomic_folder, atomic_output

class Stopped(Exception):
    pass

def stop(signum, frame):
    raise Stopped()

signal.signal(signal.SIGTERM, stop)
kind, folder = sys.argv[1], Path(sys.argv[2])
name = "mkstemp" if kind == "file" else "mkdtemp"
real = getattr(tempfile, name)

def made_then_signalled(*args, **kwargs):
    made = real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's SIGTERM, the moment the temp exists
    return made

setattr(tempfile, name, made_then_signalled)
opened = atomic_output(folder / "out.pt") if kind == "file" else atomic_folder(folder / "out")
try:
    with opened:
        print("written", flush=True)
except Stopped:
    print("stopped", flush=True)
"""


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_signal_the_moment_a_temp_is_made_leaves_no_temp(tmp_path, kind):
    """A SIGTERM (or Ctrl-C) whose handler raises just after the temp file or folder is made
    and before it is recorded for cleanup: it is held until then, so nothing is left."""
    proc = subprocess.run(
        [sys.executable, "-c", _SIGNALLED_AS_MADE, kind, str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["stopped"]  # the signal stopped it, before any write
    assert os.listdir(tmp_path) == []
