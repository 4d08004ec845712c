"""Ranged reads over HTTP(S) with the standard library: one keep-alive connection a thread.

Each read is one ``GET`` with a ``Range`` header; the ``206`` answer's ``Content-Range`` gives
the object's size, so no ``HEAD`` is needed. A server that ignores ``Range`` (``200``) is read
up to the end of the range and the connection dropped. Failures worth retrying (timeouts,
dropped connections, 5xx, 429) raise ``_Transient`` for :class:`~ckptkit.formats.io.remote.Remote`
to retry.
"""

from __future__ import annotations

import http.client
import re
import threading
import urllib.parse

from ckptkit.errors import CkptkitError, MissingFileError
from ckptkit.formats.io.remote import TIMEOUT_S, Remote, RemoteError, _Transient

__all__ = ["HttpRemote"]

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_FIRST_READ = 256 * 1024  # what the size costs when asked before any read (RangeFile's readahead)


class HttpRemote(Remote):
    """An object at an ``http://`` or ``https://`` URL."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        parts = urllib.parse.urlsplit(url)
        if not parts.hostname:
            raise RemoteError(f"{url} names no host", "give a URL such as https://host/file")
        self._https = parts.scheme.lower() == "https"
        self._host, self._port = parts.hostname, parts.port
        self._target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        self._local = threading.local()
        self._connections: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._first: tuple[int, bytes] | None = None  # the read that found the size

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=TIMEOUT_S)
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def _stat(self) -> int:
        # A first ranged read tells the size; its bytes are kept for the read that follows.
        data = self._get(0, _FIRST_READ)
        self._first = (0, data)
        assert self._size is not None
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
        assert self._size is not None
        return self._size - len(data), data

    def _get(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``; a negative ``start``: the last ``-start`` bytes."""
        conn = self._connection()
        wanted = f"bytes={start}" if start < 0 else f"bytes={start}-{end - 1}"
        try:
            conn.request("GET", self._target, headers={"Range": wanted})
            response = conn.getresponse()
            status = response.status
            if status == 206:
                self._learn_size(response.getheader("Content-Range", ""))
                data = response.read()
            elif status == 200:  # the server ignores ranges: skip to the start, stop at the end
                length = response.getheader("Content-Length")
                if length is not None:
                    self._size = int(length)
                if start < 0:
                    data = response.read()[start:]
                else:
                    response.read(start)
                    data = response.read(end - start)
                self._drop()  # the rest of the body is not wanted
            elif status == 416:  # past the end: the size is in the header
                self._learn_size(response.getheader("Content-Range", ""))
                response.read()
                data = b""
            else:
                response.read()
                if status in (404, 410):
                    raise MissingFileError(self.url)
                if status >= 500 or status in (408, 429):
                    raise _Transient(f"HTTP {status} {response.reason}")
                raise RemoteError(
                    f"{self.url} answered HTTP {status} {response.reason}",
                    "check the URL and its access rights",
                )
        except CkptkitError:  # a 404 (a FileNotFoundError, but not one to retry) or a 403
            raise
        except (OSError, http.client.HTTPException) as exc:  # timeouts and dropped connections
            self._drop()
            self.traffic.add(0)
            raise _Transient(f"{type(exc).__name__}: {exc}") from None
        self.traffic.add(len(data))
        return data

    def _learn_size(self, header: str) -> None:
        match = _CONTENT_RANGE.fullmatch(header.strip())
        if match is None or match[3] == "*":
            raise RemoteError(
                f"{self.url}: the server's Content-Range ({header!r}) gives no size",
                "serve the file from a server that supports range requests",
            )
        self._size = int(match[3])

    def close(self) -> None:
        with self._lock:
            for conn in self._connections:
                conn.close()
            self._connections.clear()
