"""A folder's files read by name, on disk or at a URL, with what a listing gave kept."""

from __future__ import annotations

from collections.abc import Iterable

from ckptkit.errors import MissingFileError
from ckptkit.storage.backends.base import RemoteError
from ckptkit.storage.location import Location, size
from ckptkit.storage.pieces import RangeReader
from ckptkit.storage.rangefile import RangeFile
from ckptkit.storage.remote import RemotePath

__all__ = ["FolderFiles"]


class FolderFiles:
    """The files of a folder a reader reads by name (a DCP save's), on disk or at a URL. At a
    URL, one listing (where the store lists) says which files are there and their sizes; over
    HTTP, a missing one is found by one request, once. Each file at a URL is read through one
    RangeFile on ``reader``'s connection to it; a local one, by its reader (``url_file`` is
    None)."""

    def __init__(self, folder: Location, reader: RangeReader, *, join_gap: int) -> None:
        self.folder, self._reader, self._join_gap = folder, reader, join_gap
        self._remote = isinstance(folder, RemotePath)
        self._opened: dict[str, RangeFile] = {}
        self._missing: set[str] = set()
        self._listed: dict[str, int | None] | None = None
        if isinstance(folder, RemotePath):
            self._listed = folder.listing()

    def has(self, name: str) -> bool:
        if not self._remote:
            return (self.folder / name).is_file()
        if self._listed is not None:
            return name in self._listed and self._listed[name] is not None  # None: a folder
        try:
            self.size(name)
        except (MissingFileError, RemoteError):  # a 403 where listing is not allowed: absent
            return False
        return True

    def size(self, name: str) -> int:
        """Its size (-1 for a local file that is not there)."""
        if not self._remote:
            path = self.folder / name
            return size(path) if path.is_file() else -1
        if name in self._missing:
            raise MissingFileError(str(self.folder / name))
        try:
            return int(self.file(name).remote.size)
        except (MissingFileError, RemoteError):
            self._missing.add(name)
            raise

    def file(self, name: str) -> RangeFile:
        """The file at the URL, opened once."""
        if name not in self._opened:
            listed = (self._listed or {}).get(name)
            remote = self._reader.remote(self.folder / name, listed)
            assert remote is not None  # the folder is at a URL
            self._opened[name] = RangeFile(remote)
        return self._opened[name]

    def url_file(self, name: str) -> RangeFile | None:
        """:meth:`file` in a folder at a URL; None in a local one (read by its own reader)."""
        return self.file(name) if self._remote else None

    def read(self, name: str) -> bytes:
        """A small file's bytes."""
        if not self._remote:
            return (self.folder / name).read_bytes()
        raw = self.file(name)
        return raw.pread(0, raw.remote.size)

    def prefetch(self, places: Iterable[tuple[Location, int, int]]) -> None:
        """Fetch the given places of files at the URL, each file's in one request where they
        lie close together (``dcp.save`` writes a rank's values first, side by side): the
        plain values of a save are read together, not one request each."""
        if not self._remote:
            return
        spans: dict[str, list[tuple[int, int]]] = {}
        for path, start, length in places:
            spans.setdefault(path.name, []).append((start, start + length))
        for name, found in spans.items():
            found.sort()
            begin, end = found[0]
            for start, stop in found[1:]:
                if start - end > self._join_gap:
                    self.file(name).prefetch(begin, end)
                    begin = start
                end = max(end, stop)
            self.file(name).prefetch(begin, end)

    def close(self) -> None:
        for raw in self._opened.values():
            raw.close()
        self._opened.clear()
