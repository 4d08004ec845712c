"""Byte-range copies and comparisons between real files, on the libc path and the plain one."""

from __future__ import annotations

import mmap
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.errors import FormatError
from ckptkit.storage import bytecopy


@pytest.fixture(params=["memcmp", "reads"])
def compare_path(request, monkeypatch):
    """Run a test through mapped memcmp and through the read-into-buffers fallback."""
    if request.param == "reads":
        monkeypatch.setattr(bytecopy, "_libc", lambda: None)
    else:
        assert bytecopy._libc() is not None, "ctypes cannot reach libc on this machine"
    return request.param


def _files(tmp_path, data: bytes, shift: int):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(data)
    b.write_bytes(b"\x00" * shift + data)
    return os.open(a, os.O_RDONLY), os.open(b, os.O_RDONLY)


# Sizes around the compare chunk and window, where an off-by-one would hide.
SIZES = [0, 1, 4095, 4097, bytecopy.COMPARE_CHUNK + 3, bytecopy.WINDOW + 5]


@pytest.mark.parametrize("size", SIZES)
def test_same_bytes_finds_every_flipped_byte(tmp_path, compare_path, size):
    data = os.urandom(size + 11)
    fd_a, fd_b = _files(tmp_path, data, shift=4099)  # not on a page or granule boundary
    try:
        assert bytecopy.same_bytes(fd_a, 7, fd_b, 4099 + 7, size)
        for where in {0, size // 2, size - 1} if size else set():
            changed = bytearray(data)
            changed[7 + where] ^= 0x01
            (tmp_path / "b").write_bytes(b"\x00" * 4099 + changed)  # the same inode: fd_b sees it
            assert not bytecopy.same_bytes(fd_a, 7, fd_b, 4099 + 7, size), where
    finally:
        os.close(fd_a)
        os.close(fd_b)


def test_a_range_past_the_end_is_not_the_same(tmp_path, compare_path):
    fd_a, fd_b = _files(tmp_path, b"x" * 100, shift=0)
    try:
        assert bytecopy.same_bytes(fd_a, 0, fd_b, 0, 100)
        assert not bytecopy.same_bytes(fd_a, 0, fd_b, 0, 101)
        assert not bytecopy.same_bytes(fd_a, 50, fd_b, 0, 51)
    finally:
        os.close(fd_a)
        os.close(fd_b)


@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=20_000), offset=st.integers(0, 9000), flip=st.integers(0, 30_000))
def test_same_bytes_agrees_with_python(tmp_path_factory, data, offset, flip):
    """same_bytes answers exactly what comparing the two slices in Python answers."""
    folder = tmp_path_factory.mktemp("cmp")
    other = bytearray(data)
    if flip < len(other):
        other[flip] ^= 0x80
    (folder / "a").write_bytes(data)
    (folder / "b").write_bytes(b"\x01" * offset + bytes(other))
    fd_a, fd_b = os.open(folder / "a", os.O_RDONLY), os.open(folder / "b", os.O_RDONLY)
    try:
        assert bytecopy.same_bytes(fd_a, 0, fd_b, offset, len(data)) == (bytes(other) == data)
    finally:
        os.close(fd_a)
        os.close(fd_b)


COPIERS = ["_mapped_write", "_copy_file_range", "_read_write"]


@pytest.mark.parametrize("copier", COPIERS)
def test_each_copier_appends_the_exact_bytes(tmp_path, monkeypatch, copier):
    monkeypatch.setattr(bytecopy, "_COPIERS", (getattr(bytecopy, copier),))
    # More than one window and chunk, from an offset that is not on a page.
    data = os.urandom(bytecopy.CHUNK + bytecopy.COPY_WINDOW + 12345)
    (tmp_path / "src").write_bytes(data)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(dst, b"head")
        bytecopy.copy_range(src, 5, len(data) - 9, dst)
        bytecopy.copy_range(src, 0, 0, dst)
    finally:
        os.close(src)
        os.close(dst)
    assert (tmp_path / "dst").read_bytes() == b"head" + data[5:-4]


@pytest.mark.parametrize("copier", COPIERS)
def test_a_short_source_is_an_error_not_a_short_file(tmp_path, monkeypatch, copier):
    monkeypatch.setattr(bytecopy, "_COPIERS", (getattr(bytecopy, copier),))
    (tmp_path / "src").write_bytes(b"x" * 5000)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(FormatError, match="the source ended early"):
            bytecopy.copy_range(src, 100, 5000, dst)
    finally:
        os.close(src)
        os.close(dst)


def test_a_file_that_cannot_be_mapped_is_copied_by_the_next_way(tmp_path, monkeypatch):
    """A window that fails to map hands over to copy_file_range / read-write mid-range."""
    real_mmap, calls = mmap.mmap, []

    def mmap_fails_second_time(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise OSError(19, "No such device")  # ENODEV: what a filesystem without mmap says
        return real_mmap(*args, **kwargs)

    monkeypatch.setattr(bytecopy.mmap, "mmap", mmap_fails_second_time)
    data = os.urandom(3 * bytecopy.COPY_WINDOW)
    (tmp_path / "src").write_bytes(data)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT)
    try:
        bytecopy.copy_range(src, 0, len(data), dst)
    finally:
        os.close(src)
        os.close(dst)
    assert len(calls) == 2 and (tmp_path / "dst").read_bytes() == data


def test_preallocate_reserves_the_size(tmp_path):
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT)
    try:
        bytecopy.preallocate(fd, 5_000_000)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if not hasattr(bytecopy._libc(), "fallocate"):  # not Linux: left to the writes
        assert size == 0
    else:  # every filesystem a test folder lies on here (ext4, xfs, btrfs, tmpfs) has it
        assert size == 5_000_000
        assert os.stat(tmp_path / "out").st_blocks * 512 >= 5_000_000


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=0, max_size=3 * mmap.ALLOCATIONGRANULARITY), st.data())
def test_a_mapped_range_is_the_files_bytes_there(tmp_path_factory, data, draw):
    path = tmp_path_factory.mktemp("mapped") / "f"
    path.write_bytes(data)
    start = draw.draw(st.integers(0, len(data)))
    count = draw.draw(st.integers(0, len(data) - start))
    mapped = bytecopy.map_range(path, start, count)
    assert bytes(mapped.view) == data[start : start + count]
    mapped.close()
    with pytest.raises(FormatError, match="run past the end of the file"):
        bytecopy.map_range(path, start, len(data) - start + 1)


def test_write_all_of_finishes_a_short_writev(tmp_path, monkeypatch):
    """``writev`` may take fewer bytes than it is given: the rest follows, in order."""
    views = [memoryview(b"abc"), memoryview(b""), memoryview(b"defgh"), memoryview(b"ij")]
    real = os.writev

    def short(fd, buffers):  # takes the first four bytes only
        return real(fd, [b"".join(buffers)[:4]])

    monkeypatch.setattr(bytecopy.os, "writev", short)
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT)
    try:
        bytecopy.write_all_of(fd, views)
    finally:
        os.close(fd)
    assert (tmp_path / "out").read_bytes() == b"abcdefghij"
    assert b"".join(bytecopy.zeros(5)) == bytes(5) and bytecopy.zeros(0) == []
    assert [len(z) for z in bytecopy.zeros((1 << 20) + 3)] == [
        1 << 20,
        3,
    ]
