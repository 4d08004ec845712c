"""A tensor's bytes in pieces: ``(file, offset, length)`` ranges of local files or of objects
at URLs (a sharded layout's chunks), read into one buffer, each file opened once."""

from __future__ import annotations

import os
from typing import Any

from ckptkit.errors import FormatError
from ckptkit.storage.backends import open_remote
from ckptkit.storage.backends.base import Remote
from ckptkit.storage.bytecopy import read_into
from ckptkit.storage.rangefile import RangeFile
from ckptkit.storage.remote import RemotePath

__all__ = ["RangeReader"]


class RangeReader:
    """Reads byte ranges of several files (a sharded layout's pieces) into one buffer, each file
    opened once and kept open until :meth:`close`."""

    def __init__(self) -> None:
        self._fds: dict[Any, int] = {}
        self._remotes: dict[str, Remote] = {}  # a URL's Remote, per URL

    def remote(self, path: Any, size: int | None = None) -> Remote | None:
        """The Remote of a file at a URL (a RemotePath), opened once and kept until
        :meth:`close` (``size`` when a listing gave it); None for a local file."""
        if not isinstance(path, RemotePath):
            return None
        if str(path) not in self._remotes:
            self._remotes[str(path)] = open_remote(path, size=size)
        return self._remotes[str(path)]

    def file(self, path: Any) -> RangeFile | None:
        """A file at a URL as a RangeFile read through its kept Remote (its size from its
        folder's listing where that was made); None for a local file."""
        remote = self.remote(path, path.listed_size() if isinstance(path, RemotePath) else None)
        return RangeFile(remote) if remote is not None else None

    def fd(self, path: Any) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def forget(self, path: Any) -> None:
        """Close ``path``'s descriptor (an output uploaded and deleted: its blocks freed)."""
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def read(self, pieces: Any, buf: memoryview) -> None:
        """Fill ``buf`` with the ``(path, offset, length)`` pieces, end to end.

        Raises:
            FormatError: a file ends before its piece does.
        """
        at = 0
        for path, offset, length in pieces:
            remote = self.remote(path) if length else None
            if remote is not None:  # a URL: one ranged read
                data = remote.read(offset, offset + length)
                if len(data) != length:
                    raise FormatError(f"{path} is truncated", "copy or download it again")
                buf[at : at + length] = data
            elif length and not read_into(self.fd(path), buf[at : at + length], offset):
                raise FormatError(f"{path} is truncated", "copy or download it again")
            at += length

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for remote in self._remotes.values():
            remote.close()
        self._remotes.clear()
