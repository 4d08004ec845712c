"""A remote object as a read-only binary file: ``seek``, ``tell``, ``read``, ``readinto``.

The readers of headers (safetensors, a zip's directory, a pickle) take a file object; given a
``RangeFile`` they work on a URL unchanged. Each read the cache cannot answer costs one ranged
request of at least ``readahead`` bytes, so a reader's many small reads (a zip's records, a
local header) cost one request, and blocks already fetched are kept (up to ``cache_bytes``,
oldest dropped first) because the readers go over the same headers more than once.
"""

from __future__ import annotations

import io
from typing import Any

from ckptkit.storage.backends.base import Remote

__all__ = ["RangeFile", "READAHEAD"]

READAHEAD = 256 * 1024
# Headers only: a 100,000-tensor zip's directory and pickle are 25 MB. Reads of tensor data
# larger than READAHEAD go around the cache, so memory holds what is being read, not all of it.
CACHE_BYTES = 64 * 1024 * 1024


class RangeFile(io.RawIOBase):
    """Read-only, seekable view of a :class:`Remote` (see the module's docstring)."""

    def __init__(
        self, remote: Remote, *, readahead: int = READAHEAD, cache_bytes: int = CACHE_BYTES
    ) -> None:
        super().__init__()
        self.remote = remote
        self.name = remote.url
        self._pos = 0
        self._readahead = readahead
        self._cache_bytes = cache_bytes
        self._blocks: dict[int, bytes] = {}  # start -> bytes, in the order they came

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self.remote.size + offset
        else:
            raise ValueError(f"whence {whence}")
        if pos < 0:
            raise OSError(22, "negative seek position")
        self._pos = pos
        return pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.pread(self._pos, len(view))
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = max(0, self.remote.size - self._pos)
        data = self.pread(self._pos, size)
        self._pos += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def pread(self, start: int, count: int) -> bytes:
        """``count`` bytes from ``start`` (fewer at the end), from the cache where it has them."""
        end = min(start + count, self.remote.size)
        if end <= start:
            return b""
        pieces, at = [], start
        for begin, block in sorted(self._blocks.items()):
            stop = begin + len(block)
            if stop <= at or begin >= end:
                continue
            if begin > at:  # a gap before this block: fetched (kept when it is small)
                if begin - at > self._readahead:
                    pieces.append(self.remote.read(at, begin))
                else:
                    pieces.append(self._fetch(at, begin))
                at = begin
            take = block[at - begin : min(stop, end) - begin]
            pieces.append(take)
            at += len(take)
            if at >= end:
                break
        if at < end:
            if end - at > self._readahead:  # tensor data: read as asked, not kept
                pieces.append(self.remote.read(at, end))
            else:
                pieces.append(self._fetch(at, end, ahead=True))
        data = b"".join(pieces)
        return data[: end - start]

    def cached(self, start: int, end: int) -> bytes | None:
        """``[start, end)`` when one cached block holds it whole, else None (no request; safe
        to call from several threads while nothing is fetched)."""
        for begin, block in list(self._blocks.items()):
            if begin <= start and end <= begin + len(block):
                return block[start - begin : end - begin]
        return None

    def prefetch(self, start: int, end: int) -> None:
        """Fetch ``[start, end)`` in one request now (a reader knows it will want it)."""
        end = min(end, self.remote.size)
        if end > start:
            self._keep(start, self.remote.read(start, end))

    def prefetch_tail(self, count: int) -> None:
        """Fetch the last ``count`` bytes in one request (a zip's directory is at the end),
        unless a read already brought them (a small file, read whole by the first request)."""
        size = self.remote.size
        start = max(0, size - count)
        if any(b <= start and b + len(d) >= size for b, d in self._blocks.items()):
            return
        start, data = self.remote.tail(count)
        self._keep(start, data)

    def _fetch(self, start: int, end: int, *, ahead: bool = False) -> bytes:
        stop = max(end, start + self._readahead) if ahead else end
        data = self.remote.read(start, stop)
        self._keep(start, data)
        return data[: end - start]

    def _keep(self, start: int, data: bytes) -> None:
        if not data or len(data) > self._cache_bytes:
            return
        self._blocks.pop(start, None)  # kept anew: the newest
        self._blocks[start] = data
        total = sum(len(b) for b in self._blocks.values())
        for begin in list(self._blocks):
            if total <= self._cache_bytes or begin == start:
                break
            total -= len(self._blocks.pop(begin))

    def close(self) -> None:
        """Drop the cache and close the remote's connections (the file owns its remote)."""
        self._blocks.clear()
        self.remote.close()
        super().close()
