"""Copying byte ranges between files without passing them through Python objects.

``os.copy_file_range`` lets the kernel copy (or share extents) directly; ``os.sendfile`` is the
older kernel path; a read/write loop is the portable fallback. Memory use stays at one chunk.
"""

from __future__ import annotations

import errno
import os

from ckptkit.errors import FormatError

__all__ = ["copy_range", "write_all", "same_bytes", "CHUNK"]

CHUNK = 8 * 1024 * 1024
_UNSUPPORTED = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}


def copy_range(src_fd: int, offset: int, count: int, dst_fd: int) -> None:
    """Append ``count`` bytes of ``src_fd`` from ``offset`` at ``dst_fd``'s current position."""
    for method in (_copy_file_range, _sendfile, _read_write):
        try:
            done = method(src_fd, offset, count, dst_fd)
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise
            continue
        offset, count = offset + done, count - done
        if not count:
            return
    raise FormatError("the source ended early while copying a tensor's bytes", "copy it again")


def _copy_file_range(src_fd: int, offset: int, count: int, dst_fd: int) -> int:
    if not hasattr(os, "copy_file_range"):
        raise OSError(errno.ENOSYS, "no copy_file_range")
    done = 0
    while done < count:
        n = os.copy_file_range(src_fd, dst_fd, count - done, offset + done)
        if n == 0:
            break
        done += n
    return done


def _sendfile(src_fd: int, offset: int, count: int, dst_fd: int) -> int:
    done = 0
    while done < count:
        n = os.sendfile(dst_fd, src_fd, offset + done, count - done)
        if n == 0:
            break
        done += n
    return done


def _read_write(src_fd: int, offset: int, count: int, dst_fd: int) -> int:
    done = 0
    while done < count:
        chunk = os.pread(src_fd, min(CHUNK, count - done), offset + done)
        if not chunk:
            break
        write_all(dst_fd, memoryview(chunk))
        done += len(chunk)
    return done


def write_all(fd: int, data: memoryview) -> None:
    """Write all of ``data`` at ``fd`` (``os.write`` may take less than it is given)."""
    while data:
        data = data[os.write(fd, data) :]


def same_bytes(fd_a: int, offset_a: int, fd_b: int, offset_b: int, count: int) -> bool:
    """True when two byte ranges are identical (compared a chunk at a time)."""
    done = 0
    while done < count:
        size = min(CHUNK, count - done)
        a = os.pread(fd_a, size, offset_a + done)
        if len(a) != size or a != os.pread(fd_b, size, offset_b + done):
            return False
        done += size
    return True
