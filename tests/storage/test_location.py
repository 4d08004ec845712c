"""storage/location.py on its own: one protocol for a local path and a URL (fsspec's real
memory:// back-end), what differs between them asked of the module, and the one request
counter of a command."""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import uuid

import fsspec
import pytest

from ckptkit.errors import FormatError
from ckptkit.storage.backends.base import counting
from ckptkit.storage.location import (
    Location,
    absolute_parts,
    by_name,
    fresh_names,
    head,
    holds_file,
    is_local,
    listable,
    listing,
    local_path,
    location,
    may_be_folder,
    size,
    url_file,
)
from ckptkit.storage.remote import RemotePath


@pytest.fixture
def both(tmp_path):
    """The same folder on disk and at memory://: ``b.bin`` (300 bytes), ``a.txt``, ``sub/``."""
    url = f"memory://location-{uuid.uuid4().hex}/folder"
    fs = fsspec.filesystem("memory")
    root = url.split("://", 1)[1]
    for where in (tmp_path, None):
        for name, data in (("b.bin", bytes(range(256)) + b"x" * 44), ("a.txt", b"a")):
            if where is None:
                fs.pipe_file(f"{root}/{name}", data)
            else:
                (where / name).write_bytes(data)
    (tmp_path / "sub").mkdir()
    fs.pipe_file(f"{root}/sub/c", b"c")
    (tmp_path / "sub" / "c").write_bytes(b"c")
    yield location(tmp_path), location(url)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(root.split("/", 1)[0], recursive=True)


def test_a_string_becomes_local_or_remote_in_one_place(tmp_path):
    assert location(str(tmp_path)) == tmp_path and is_local(location(str(tmp_path)))
    remote = location("s3://bucket/run/model.safetensors")
    assert isinstance(remote, RemotePath) and not is_local(remote)
    assert location(remote) is remote  # what it learnt of its folder is kept
    assert isinstance(tmp_path, Location) and isinstance(remote, Location)


def test_a_local_folder_and_one_at_a_url_answer_alike(both):
    for folder in both:
        assert [p.name for p in by_name(folder.iterdir())] == ["a.txt", "b.bin", "sub"]
        assert listing(folder) == {"a.txt": 1, "b.bin": 300, "sub": None}
        assert sorted(fresh_names(folder) or []) == ["a.txt", "b.bin", "sub"]
        assert size(folder / "b.bin") == 300 and head(folder / "b.bin", 4) == bytes([0, 1, 2, 3])
        assert holds_file(folder / "a.txt") and not holds_file(folder / "sub")
        assert (folder / "sub" / "c").read_bytes() == b"c" and listable(folder)


def test_only_a_url_is_read_through_a_byte_file(both):
    local, remote = both
    assert url_file(local / "b.bin") is None  # its reader maps or kernel-copies it
    raw = url_file(remote / "b.bin")
    assert raw is not None
    with raw:
        assert raw.pread(250, 10) == bytes(range(250, 256)) + b"xxxx"
    assert local_path(local / "b.bin") == local / "b.bin"
    with pytest.raises(TypeError, match="not on the local disk"):
        local_path(remote / "b.bin")


def test_naming_and_folder_hints():
    assert absolute_parts(location("s3://bucket/runs/a")) == ("s3://bucket", "runs", "a")
    assert absolute_parts(location("/runs/a")) == ("/", "runs", "a")
    assert not may_be_folder(location("s3://b/x.safetensors"))
    assert not may_be_folder(location("s3://b/save/.metadata"))
    assert may_be_folder(location("s3://b/save")) and may_be_folder(location("x.pt"))
    assert not listable(location("https://example.invalid/run"))


def test_a_fifo_is_refused_unopened(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    assert holds_file(fifo)  # there, so its reader refuses it by name
    with pytest.raises(FormatError):
        head(fifo, 8)  # never opened: opening a FIFO would block


def test_a_command_counts_every_request_even_from_another_thread(both):
    _, remote = both
    seen: list[bytes] = []
    with counting() as traffic:
        assert listing(remote)["b.bin"] == 300  # a listing: one request
        # A remote counts where it is opened: a thread run in the caller's context (as the
        # shards' pool runs each opener) counts in the command's counter too.
        context = contextvars.copy_context()
        worker = threading.Thread(
            target=context.run, args=(lambda: seen.append(head(remote / "b.bin", 8)),)
        )
        worker.start()
        worker.join()
    assert seen == [bytes(range(8))]
    assert traffic.requests == 2 and traffic.bytes == 300  # the listing, then one read
    with counting() as later:
        assert (remote / "a.txt").read_bytes() == b"a"
    assert later.requests == 1 and traffic.requests == 2  # each command its own counter
