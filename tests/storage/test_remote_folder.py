"""storage/remote_folder.py on its own: a folder at a URL that a writer keeps (what
``train --out URL`` does there), on fsspec's memory:// back-end."""

from __future__ import annotations

import contextlib
import uuid

import fsspec
import pytest

from ckptkit.errors import UsageError
from ckptkit.storage.remote_folder import RemoteFolder


@pytest.fixture
def folder():
    """A fresh folder at memory://, holding ``a.txt``, ``logs/one`` and ``logs/sub/two``."""
    url = f"memory://remote-folder-{uuid.uuid4().hex}/run/"
    fs = fsspec.filesystem("memory")
    root = url.split("://", 1)[1]
    fs.pipe_file(f"{root}a.txt", b"a")
    fs.pipe_file(f"{root}logs/one", b"1")
    fs.pipe_file(f"{root}logs/sub/two", b"2")
    yield RemoteFolder(url)
    with contextlib.suppress(FileNotFoundError):  # removed by the test itself
        fs.rm(root.split("/", 1)[0], recursive=True)


def test_names_urls_and_locations(folder):
    assert folder.url.endswith("/run") and str(folder) == folder.url
    assert sorted(folder.names()) == ["a.txt", "logs"]
    assert folder.child("a.txt") == folder.url + "/a.txt"
    assert folder.location("a.txt").read_bytes() == b"a"
    assert RemoteFolder(folder.child("nothing")).names() == []


def test_reads_writes_and_probes(folder):
    assert folder.read("a.txt") == b"a"
    with pytest.raises(FileNotFoundError):
        folder.read("missing")
    folder.write("b.txt", b"bee")
    assert folder.exists("b.txt", fresh=True) and folder.read("b.txt") == b"bee"
    assert folder.is_folder() and folder.is_folder("logs") and not folder.is_folder("a.txt")
    folder.write_and_remove(".probe")
    assert not folder.exists(".probe", fresh=True)


def test_downloads(folder, tmp_path):
    folder.download("a.txt", tmp_path / "a.txt")
    assert (tmp_path / "a.txt").read_bytes() == b"a"
    with pytest.raises(FileNotFoundError):
        folder.download("missing", tmp_path / "missing")
    folder.download_folder("logs", tmp_path / "logs")
    assert (tmp_path / "logs" / "sub" / "two").read_bytes() == b"2"
    RemoteFolder(folder.child("a.txt")).download(None, tmp_path / "whole")
    assert (tmp_path / "whole").read_bytes() == b"a"


def test_removals(folder):
    folder.remove("logs")
    assert folder.names() == ["a.txt"]
    folder.clear()
    assert folder.names() == []
    folder.clear()  # nothing there: nothing to do


def test_uploads_are_committed_in_order(folder, tmp_path):
    local = tmp_path / "up.bin"
    local.write_bytes(b"up")
    with folder.uploads() as uploads:
        uploads.add(local, "up.bin")
        uploads.commit()
    assert folder.read("up.bin") == b"up" and not local.exists()


def test_http_is_refused_when_written_not_before():
    there = RemoteFolder("https://example.invalid/run")  # nothing asked yet
    with pytest.raises(UsageError, match="cannot write to"):
        there.uploads()
