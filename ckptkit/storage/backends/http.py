"""Ranged reads over HTTP(S) with the standard library's ``http.client``.

Each read is one ``GET`` with a ``Range`` header; the ``206`` answer's ``Content-Range`` gives
the object's size, so no ``HEAD`` is needed. Redirects (Hugging Face's ``resolve`` URLs, release
assets) are followed, a few hops, and the last location is kept for the reads that follow (a
redirect from https to plain http is refused: the bytes would travel unprotected).
Connections are kept alive in a pool: a thread takes an idle one or opens one, and gives it
back, so there are never more open than reads in flight. A server that ignores ``Range``
(answering ``200`` with the whole object) is refused unless the read starts at byte 0: reading
on to a later range would fetch everything before it, again for every read. Failures worth
retrying (timeouts, dropped connections, 5xx, 429) raise ``_Transient`` for
:class:`~ckptkit.storage.remote.Remote` to retry.

A server is not trusted to answer what was asked: an answer is used only when its
``Content-Range`` is the range asked (start, end, and the size known so far), its
``Content-Length`` says as much, and its body holds that many bytes; no more than that is ever
read (one byte more, to tell a body that runs on). Each request has a total deadline
(:func:`~ckptkit.storage.remote.deadline_s`): a server that drips its answer has the
connection cut when it passes.
"""

from __future__ import annotations

import contextlib
import http.client
import re
import socket
import threading
import urllib.parse

from ckptkit.errors import CkptkitError, MissingFileError
from ckptkit.storage.backends.base import (
    TIMEOUT_S,
    Remote,
    RemoteError,
    _Transient,
    deadline_s,
)

__all__ = ["HttpRemote"]

_CONTENT_RANGE = re.compile(r"bytes ([0-9]+)-([0-9]+)/([0-9]+|\*)")
_UNSATISFIED = re.compile(r"bytes \*/([0-9]+)")
_LENGTH = re.compile(r"[0-9]+")
_FIRST_READ = 256 * 1024  # what the size costs when asked before any read (RangeFile's readahead)
_REDIRECTS = {301, 302, 303, 307, 308}
_MAX_HOPS = 5

_Connection = http.client.HTTPConnection


class HttpRemote(Remote):
    """An object at an ``http://`` or ``https://`` URL."""

    def __init__(self, url: str, size: int | None = None) -> None:
        super().__init__(url, size)
        self._lock = threading.Lock()
        self._idle: list[_Connection] = []  # kept alive between reads
        self._first: tuple[int, bytes] | None = None  # the read that found the size
        self._https = False
        self._locate(url)

    def _locate(self, url: str) -> None:
        """Where the reads go (the URL given, or where it redirected)."""
        parts = urllib.parse.urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise RemoteError(f"{self.url}: cannot read {url}", "give a URL such as https://h/f")
        if self._https and scheme == "http":
            raise RemoteError(
                f"{self.url} redirects from https to plain http ({url})",
                "give the URL it should be read from, over https",
            )
        with self._lock:
            for conn in self._idle:  # to another server, maybe: none of these serve it
                conn.close()
            self._idle.clear()
            self._https = scheme == "https"
            self._host, self._port = parts.hostname, parts.port
            self._target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
            self._where = url

    def _take(self) -> _Connection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            https, host, port = self._https, self._host, self._port
        cls = http.client.HTTPSConnection if https else http.client.HTTPConnection
        return cls(host, port, timeout=TIMEOUT_S)

    def _give_back(self, conn: _Connection) -> None:
        with self._lock:
            self._idle.append(conn)

    def _stat(self) -> int:
        # A first ranged read tells the size; its bytes are kept for the read that follows.
        data = self._get(0, _FIRST_READ)
        self._first = (0, data)
        return self._known_size()

    def _known_size(self) -> int:
        if self._size is None:
            raise RemoteError(
                f"{self.url}: the server gives no size for it",
                "serve it from a server that supports HTTP range requests, or download it",
            )
        return self._size

    def _range(self, start: int, end: int) -> bytes:
        first = self._first
        if first is not None and first[0] <= start and end <= first[0] + len(first[1]):
            self._first = None  # handed over once: the caller caches what it keeps
            return first[1][start - first[0] : end - first[0]]
        return self._get(start, end)

    def tail(self, count: int) -> tuple[int, bytes]:
        if self._size is not None:
            return super().tail(count)
        # A suffix range: the last bytes and, in Content-Range, the size, in one request.
        data = self._retried(lambda: self._get(-count, 0), f"read the last {count} bytes of")
        return self._known_size() - len(data), data

    def _get(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``; a negative ``start``: the last ``-start`` bytes."""
        for _ in range(_MAX_HOPS + 1):
            location = self._request(start, end)
            if isinstance(location, bytes):
                return location
            self._locate(urllib.parse.urljoin(self._where, location))
        raise RemoteError(f"{self.url} redirects more than {_MAX_HOPS} times", "check the URL")

    def _request(self, start: int, end: int) -> bytes | str:
        """One GET, cut at its deadline: the bytes, or where a redirect points."""
        conn = self._take()
        allowed = deadline_s(-start if start < 0 else end - start)
        watch = _Watch(conn, allowed)
        try:
            try:
                answer, reusable = self._exchange(conn, start, end)
            finally:
                in_time = watch.stop()
            if not in_time:
                raise _Transient(_late(allowed))
        except (CkptkitError, _Transient, OSError, http.client.HTTPException) as exc:
            conn.close()
            self.traffic.add(0)
            if not in_time:  # whatever the cut connection made of the answer: it was late
                raise _Transient(_late(allowed)) from None
            if isinstance(exc, (CkptkitError, _Transient)):  # a 404, a 403, a 5xx, a mismatch
                raise
            # timeouts and dropped connections
            raise _Transient(f"{type(exc).__name__}: {exc}") from None
        if reusable:
            self._give_back(conn)
        else:
            conn.close()
        self.traffic.add(len(answer) if isinstance(answer, bytes) else 0)
        return answer

    def _exchange(self, conn: _Connection, start: int, end: int) -> tuple[bytes | str, bool]:
        """The request and its answer: (the bytes or a redirect's location, whether the
        connection may serve another request)."""
        wanted = f"bytes={start}" if start < 0 else f"bytes={start}-{end - 1}"
        conn.request("GET", self._target, headers={"Range": wanted})
        response = conn.getresponse()
        status = response.status
        if status == 206:
            return self._partial(response, start, end), True
        if status == 416:  # past the end (or an empty object): the size is in the header
            self._unsatisfied(response, start)
            return b"", False
        if status == 200:  # the rest of the body is not wanted: the connection goes
            return self._whole(response, start, end), False
        if status in _REDIRECTS and response.getheader("Location"):
            return str(response.getheader("Location")), False
        if status in (404, 410):
            raise MissingFileError(self.url)
        if status >= 500 or status in (408, 429):
            raise _Transient(f"HTTP {status} {response.reason}")
        raise RemoteError(
            f"{self.url} answered HTTP {status} {response.reason}",
            "check the URL and its access rights",
        )

    def _partial(self, response: http.client.HTTPResponse, start: int, end: int) -> bytes:
        """A ``206``'s body, once its headers say it is the range asked, read no further than
        that range (and one byte, to tell a body that runs on)."""
        header = response.getheader("Content-Range", "")
        match = _CONTENT_RANGE.fullmatch(header.strip())
        if match is None or match[3] == "*":
            raise RemoteError(
                f"{self.url}: the server's Content-Range ({header!r}) gives no size",
                "serve the file from a server that supports range requests",
            )
        first, last, size = int(match[1]), int(match[2]), int(match[3])
        asked = f"bytes {start}-{end - 1}" if start >= 0 else f"the last {-start} bytes"
        if start < 0:  # a suffix: the last bytes, however many there are
            start, end = max(0, size + start), size
        if (first, last) != (start, min(end, size) - 1) or (
            self._size is not None and size != self._size
        ):
            raise _Transient(f"asked for {asked}, the server answered {header.strip()!r}")
        want = last - first + 1
        length = _length(self.url, response)
        if length is not None and length != want:
            raise _Transient(
                f"the server's Content-Length ({length}) is not the {want} bytes of "
                f"its Content-Range ({header.strip()!r})"
            )
        data = response.read(want + 1)
        if len(data) > want:
            raise _Transient(f"the server sent more than the {want} bytes asked for")
        self._size = size
        return data

    def _unsatisfied(self, response: http.client.HTTPResponse, start: int) -> None:
        """A ``416``: the size is in its ``Content-Range``, and must say why it was refused."""
        header = response.getheader("Content-Range", "")
        match = _UNSATISFIED.fullmatch(header.strip())
        if match is None:
            raise RemoteError(
                f"{self.url}: the server's Content-Range ({header!r}) gives no size",
                "serve the file from a server that supports range requests",
            )
        size = int(match[1])
        if (start >= 0 and start < size) or (start < 0 and size != 0):
            raise _Transient(f"the server refused a range inside its {size} bytes (HTTP 416)")
        self._size = size

    def _whole(self, response: http.client.HTTPResponse, start: int, end: int) -> bytes:
        """A ``200`` (the server ignores ``Range``): the start of the body when that is what
        was asked; anything else would mean reading the whole object, again for every read."""
        length = _length(self.url, response)
        if start != 0:
            raise RemoteError(
                f"{self.url}: the server ignores range requests",
                "serve it from a server that supports them (object stores do), or download it",
            )
        if length is not None:
            self._size = length
        self._known_size()
        return response.read(end - start)

    def close(self) -> None:
        with self._lock:
            for conn in self._idle:
                conn.close()
            self._idle.clear()


def _length(url: str, response: http.client.HTTPResponse) -> int | None:
    """The answer's ``Content-Length`` (None without one: a chunked body)."""
    text = response.getheader("Content-Length")
    if text is None:
        return None
    if not _LENGTH.fullmatch(text.strip()):
        raise RemoteError(
            f"{url}: the server's Content-Length is not a byte count ({text[:40]!r})",
            "serve the file from a server that answers HTTP correctly",
        )
    return int(text)


def _late(allowed: float) -> str:
    return (
        f"no whole answer within {allowed:.3g} s; CKPTKIT_REMOTE_DEADLINE and "
        "CKPTKIT_REMOTE_MIN_RATE set how long a request may take"
    )


class _Watch:
    """A request's deadline: when it passes first, the connection's socket is shut, which ends
    whatever read is waiting on it (a socket timeout alone would wait for ever on a server that
    sends a byte now and then)."""

    def __init__(self, conn: _Connection, seconds: float) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._stopped = False
        self.passed = False
        self._timer = threading.Timer(seconds, self._cut)
        self._timer.daemon = True
        self._timer.start()

    def _cut(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self.passed = True
            sock = self._conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def stop(self) -> bool:
        """Stop watching: whether the request ended before its deadline."""
        self._timer.cancel()
        with self._lock:
            self._stopped = True
            return not self.passed
