"""Byte ranges of remote files fetched ahead of the writer that needs them, ``workers`` at once.

A conversion writes tensors in a known order. :class:`Prefetcher` is given those tensors'
ranges in that order, cuts them into requests of at most ``chunk`` bytes (neighbouring small
ranges of one file share a request, a large range is split) and keeps ``workers`` requests in
flight ahead of the writer. Memory holds at most ``workers + 1`` requests' bytes whatever the
checkpoint's size. Each request goes through :meth:`Remote.read`: retried, its length checked.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from ckptkit.errors import FormatError
from ckptkit.storage.backends.base import Remote

__all__ = ["Prefetcher", "aligned", "CHUNK", "GAP"]

CHUNK = 8 * 1024 * 1024  # bytes a request at most (memory: workers + 1 of them)
GAP = 64 * 1024  # bytes between two ranges read through rather than asked for apart


@dataclass
class _Request:
    remote: Remote
    start: int
    end: int
    future: Future[bytes] | None = None
    left: int = 0  # pieces of it not taken yet


@dataclass
class _Piece:
    request: int  # index into Prefetcher._requests
    offset: int  # where the piece starts in the request's bytes
    length: int


@dataclass
class Prefetcher:
    """Fetches ``spans`` (key, remote, offset, length), in their order, ahead of :meth:`pieces`.

    Keys are taken in the planned order; a key taken out of order is still given (fetched
    then); requests planned before it and not taken are dropped.
    """

    spans: list[tuple[str, Remote, int, int]]
    workers: int = 8
    chunk: int = CHUNK
    _requests: list[_Request] = field(default_factory=list)
    _pieces: dict[str, list[_Piece]] = field(default_factory=dict)
    _pool: ThreadPoolExecutor | None = None
    _next: int = 0  # the first request not submitted yet
    _low: int = 0  # requests before this one are dropped

    def __post_init__(self) -> None:
        for key, remote, offset, length in self.spans:
            pieces = self._pieces.setdefault(key, [])
            end = offset + length
            while offset < end or length == 0:
                last = self._requests[-1] if self._requests else None
                room = 0 if last is None else self.chunk - (offset - last.start)
                if (
                    last is not None
                    and last.remote is remote
                    and 0 <= offset - last.end <= GAP
                    and (room > 0 or length == 0)
                ):
                    size = max(0, min(end - offset, room))
                    last.end = max(last.end, offset + size)  # joins the request before it
                else:
                    size = min(end - offset, self.chunk)
                    self._requests.append(_Request(remote, offset, offset + size))
                    last = self._requests[-1]
                last.left += 1
                pieces.append(_Piece(len(self._requests) - 1, offset - last.start, size))
                offset += size
                if length == 0:
                    break
        self.spans = []  # planned: the list is not needed again

    def holds(self, key: str) -> bool:
        """Whether ``key``'s range was planned (and not taken yet)."""
        return key in self._pieces

    def pieces(self, key: str) -> Iterator[bytes | memoryview]:
        """The bytes of ``key``'s range, a piece at a time, in order (views of the requests'
        bytes, not copies: a piece of 8 MiB copied would be 8 MiB more in memory)."""
        for piece in self._pieces.pop(key, []):
            request = self._requests[piece.request]
            begin = piece.offset
            if piece.request < self._low:  # released (a later key was taken first): alone
                start = request.start + begin
                yield request.remote.read(start, start + piece.length)
                continue
            self._release_before(piece.request)
            self._submit_through(piece.request + self.workers)
            assert request.future is not None
            yield memoryview(request.future.result())[begin : begin + piece.length]
            request.left -= 1
            if request.left == 0:  # taken whole: its bytes go
                request.future = None
                if piece.request == self._low:
                    self._low += 1

    def _submit_through(self, last: int) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="ckptkit-fetch")
        self._next = max(self._next, self._low)  # released ones are fetched alone if asked
        while self._next <= min(last, len(self._requests) - 1):
            request = self._requests[self._next]
            request.future = self._pool.submit(request.remote.read, request.start, request.end)
            self._next += 1

    def _release_before(self, index: int) -> None:
        """Requests planned before ``index`` and not taken whole: their bytes go (a writer
        that skips a key leaves nothing behind; a piece of them asked later is fetched alone)."""
        while self._low < index:
            request = self._requests[self._low]
            if request.future is not None:
                request.future.cancel()
                request.future = None
            self._low += 1

    def close(self) -> None:
        if self._pool is not None:
            for request in self._requests[self._low : self._next]:
                if request.future is not None:
                    request.future.cancel()
            self._pool.shutdown(wait=True)
            self._pool = None


def aligned(chunks: Iterable[bytes | memoryview], itemsize: int) -> Iterator[bytearray]:
    """Fetched bytes re-cut at element boundaries (a joined request may end inside one).

    Raises:
        FormatError: the bytes end inside an element.
    """
    rest = bytearray()
    for chunk in chunks:
        rest += chunk
        whole = len(rest) - len(rest) % itemsize
        if whole:
            yield rest[:whole]
            del rest[:whole]
    if rest:
        raise FormatError("a tensor's bytes ended inside an element", "copy it again")
