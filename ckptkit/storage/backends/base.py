"""What every remote back-end shares: the settings (tries, backoff, timeouts, a request's
deadline), the one error a remote read raises, a request counter (:class:`Traffic`), and
:class:`Remote`, one object's size and ranged reads, retried.

Transient failures (timeouts, dropped connections, 5xx, 429) are retried with exponential
backoff; a range that comes back short is a failure too. What still fails after the last try is
one :class:`RemoteError` naming the URL.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from ckptkit.errors import CkptkitError, UsageError
from ckptkit.storage.small import quoted

__all__ = ["Remote", "RemoteError", "Traffic", "TRIES", "byte_count", "counting", "deadline_s"]


def _setting(name: str, default: float) -> float:
    """A number from the environment, or its default when unset or not a number."""
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        return default
    return value if math.isfinite(value) else default


TRIES = max(1, int(_setting("CKPTKIT_REMOTE_TRIES", 5)))
BACKOFF_S = max(0.0, _setting("CKPTKIT_REMOTE_BACKOFF", 0.2))
TIMEOUT_S = max(0.1, _setting("CKPTKIT_REMOTE_TIMEOUT", 60))
# A request's total time: DEADLINE_S, plus what its bytes take at MIN_RATE bytes a second. A
# socket timeout bounds each wait for a byte, not the answer: a server that drips a byte a
# second would hold a request for days. Read when each request is made.
DEADLINE_S = 120.0
MIN_RATE = 64 * 1024


def deadline_s(nbytes: int) -> float:
    """How long one request for ``nbytes`` may take in all: ``CKPTKIT_REMOTE_DEADLINE``
    seconds (default 120), plus the time its bytes take at ``CKPTKIT_REMOTE_MIN_RATE`` bytes a
    second (default 64 KiB/s)."""
    grace = max(0.01, _setting("CKPTKIT_REMOTE_DEADLINE", DEADLINE_S))
    rate = max(1.0, _setting("CKPTKIT_REMOTE_MIN_RATE", MIN_RATE))
    return min(grace + max(0, nbytes) / rate, _LONGEST_S)


_LONGEST_S = 7 * 24 * 3600.0  # a week: what a timer can wait (1e300 s would break it)


class RemoteError(CkptkitError):
    """A remote object that could not be read (after retries), or a URL that cannot be used."""


@dataclass
class Traffic:
    """What a :class:`Remote` asked for: requests made (tries included) and bytes received."""

    requests: int = 0
    bytes: int = 0
    retries: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int) -> None:
        """A request made, and the bytes it brought (0 for one that failed)."""
        with self.lock:
            self.requests += 1
            self.bytes += nbytes

    def retried(self) -> None:
        with self.lock:
            self.retries += 1


# The Traffic of the command running in this context (see :func:`counting`).
_COMMAND: ContextVar[Traffic | None] = ContextVar("ckptkit_command_traffic", default=None)


@contextlib.contextmanager
def counting() -> Iterator[Traffic]:
    """Count every request made inside the block in one :class:`Traffic`: one counter for a
    command, which ``inspect`` reports (what reading a URL cost: listings, small files,
    headers). A request counts where its remote is opened, so the threads a remote is handed
    to (the prefetcher's) count there too."""
    traffic = Traffic()
    token = _COMMAND.set(traffic)
    try:
        yield traffic
    finally:
        _COMMAND.reset(token)


def counter() -> Traffic:
    """The running command's request counter (see :func:`counting`), else a new one."""
    return _COMMAND.get() or Traffic()


class Remote(ABC):
    """One remote object: its size and ranged reads, retried, counted in ``traffic`` (the
    command's counter when one is counting, see :func:`counting`)."""

    def __init__(self, url: str, size: int | None = None) -> None:
        self.url = url
        self.traffic = counter()
        self._size = size  # known from a listing: no request asks for it

    @property
    def size(self) -> int:
        if self._size is None:
            self._size = self._retried(self._stat, "read the size of")
        return self._size

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` (clipped to the object), in one request (retried)."""
        end = min(end, self.size) if self._size is not None else end
        if end <= start:
            return b""
        return self._retried(lambda: self._checked(start, end), f"read bytes {start}-{end} of")

    def tail(self, count: int) -> tuple[int, bytes]:
        """The last ``count`` bytes (fewer when the object is smaller) and where they start."""
        start = max(0, self.size - count)
        return start, self.read(start, self.size)

    def _checked(self, start: int, end: int) -> bytes:
        data = self._range(start, end)
        want = min(end, self.size) - start
        if len(data) != want:  # a dropped connection or a server that cut the body short
            raise _Transient(f"{len(data)} of {want} bytes came back")
        return data

    def _retried(self, call: Any, what: str) -> Any:
        delay = BACKOFF_S
        for attempt in range(TRIES):
            try:
                return call()
            except _Transient as exc:
                if attempt == TRIES - 1:
                    raise RemoteError(
                        f"could not {what} {self.url} after {TRIES} tries ({exc})",
                        "check the URL and the network, then run it again",
                    ) from None
                self.traffic.retried()
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    @abstractmethod
    def _stat(self) -> int:
        """The object's size (raises _Transient on a failure worth retrying)."""

    @abstractmethod
    def _range(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` in one request (raises _Transient to retry)."""

    def close(self) -> None:  # noqa: B027 - back-ends without connections need not override it
        """Release connections."""


def byte_count(value: Any, what: str) -> int:
    """A size a server claims, as an int: a whole number of bytes, not negative.

    Raises:
        RemoteError: anything else, naming ``what`` and the value.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise RemoteError(
        f"{what} is not a byte count ({quoted(value, 40)})",
        "check the URL; the server answered nonsense",
    )


class _Folder(UsageError):
    """A URL opened as an object that is a folder (a prefix): an error to a reader, a plain
    "no" to :meth:`RemotePath.is_file`."""


class _Transient(Exception):
    """A failure a retry may cure: a timeout, a dropped connection, a 5xx or a short body."""
