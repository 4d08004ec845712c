"""Ranged reads over HTTP(S) with the standard library's ``http.client``.

Each read is one ``GET`` with a ``Range`` header; the ``206`` answer's ``Content-Range`` gives
the object's size, so no ``HEAD`` is needed. Redirects (Hugging Face's ``resolve`` URLs, release
assets) are followed, a few hops, and the last location is kept for the reads that follow.
Connections are kept alive in a pool: a thread takes an idle one or opens one, and gives it
back, so there are never more open than reads in flight. A server that ignores ``Range``
(answering ``200`` with the whole object) is refused unless the read starts at byte 0: reading
on to a later range would fetch everything before it, again for every read. Failures worth
retrying (timeouts, dropped connections, 5xx, 429) raise ``_Transient`` for
:class:`~ckptkit.formats.io.remote.Remote` to retry.
"""

from __future__ import annotations

import http.client
import re
import threading
import urllib.parse

from ckptkit.errors import CkptkitError, MissingFileError
from ckptkit.formats.io.remote import TIMEOUT_S, Remote, RemoteError, Traffic, _Transient

__all__ = ["HttpRemote"]

_CONTENT_RANGE = re.compile(r"bytes (?:\d+-\d+|\*)/(\d+|\*)")
_FIRST_READ = 256 * 1024  # what the size costs when asked before any read (RangeFile's readahead)
_REDIRECTS = {301, 302, 303, 307, 308}
_MAX_HOPS = 5

_Connection = http.client.HTTPConnection


class HttpRemote(Remote):
    """An object at an ``http://`` or ``https://`` URL."""

    def __init__(self, url: str, traffic: Traffic | None = None, size: int | None = None) -> None:
        super().__init__(url, traffic, size)
        self._lock = threading.Lock()
        self._idle: list[_Connection] = []  # kept alive between reads
        self._first: tuple[int, bytes] | None = None  # the read that found the size
        self._locate(url)

    def _locate(self, url: str) -> None:
        """Where the reads go (the URL given, or where it redirected)."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise RemoteError(f"{self.url}: cannot read {url}", "give a URL such as https://h/f")
        with self._lock:
            for conn in self._idle:  # to another server, maybe: none of these serve it
                conn.close()
            self._idle.clear()
            self._https = parts.scheme.lower() == "https"
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
        """One GET: the bytes, or where a redirect points."""
        conn = self._take()
        wanted = f"bytes={start}" if start < 0 else f"bytes={start}-{end - 1}"
        try:
            conn.request("GET", self._target, headers={"Range": wanted})
            response = conn.getresponse()
            status = response.status
            if status == 206:
                self._learn_size(response.getheader("Content-Range", ""))
                data = response.read()
            elif status == 416:  # past the end (or an empty object): the size is in the header
                self._learn_size(response.getheader("Content-Range", ""))
                response.read()
                data = b""
            elif status == 200:
                data = self._whole(response, start, end)
                conn.close()  # the rest of the body is not wanted
                self.traffic.add(len(data))
                return data
            else:
                response.read()
                if status in _REDIRECTS and response.getheader("Location"):
                    self._give_back(conn)
                    self.traffic.add(0)
                    return str(response.getheader("Location"))
                if status in (404, 410):
                    raise MissingFileError(self.url)
                if status >= 500 or status in (408, 429):
                    raise _Transient(f"HTTP {status} {response.reason}")
                raise RemoteError(
                    f"{self.url} answered HTTP {status} {response.reason}",
                    "check the URL and its access rights",
                )
        except CkptkitError:  # a 404 (a FileNotFoundError, but not one to retry) or a 403
            conn.close()
            self.traffic.add(0)
            raise
        except _Transient:  # a 5xx or a 429: answered, to be asked again
            conn.close()
            self.traffic.add(0)
            raise
        except (OSError, http.client.HTTPException) as exc:  # timeouts and dropped connections
            conn.close()
            self.traffic.add(0)
            raise _Transient(f"{type(exc).__name__}: {exc}") from None
        self._give_back(conn)
        self.traffic.add(len(data))
        return data

    def _whole(self, response: http.client.HTTPResponse, start: int, end: int) -> bytes:
        """A ``200`` (the server ignores ``Range``): the start of the body when that is what
        was asked; anything else would mean reading the whole object, again for every read."""
        length = response.getheader("Content-Length")
        if length is not None and length.isdigit():
            self._size = int(length)
        if start != 0:
            raise RemoteError(
                f"{self.url}: the server ignores range requests",
                "serve it from a server that supports them (object stores do), or download it",
            )
        self._known_size()
        return response.read(end - start)

    def _learn_size(self, header: str) -> None:
        match = _CONTENT_RANGE.fullmatch(header.strip())
        if match is None or match[1] == "*":
            raise RemoteError(
                f"{self.url}: the server's Content-Range ({header!r}) gives no size",
                "serve the file from a server that supports range requests",
            )
        self._size = int(match[1])

    def close(self) -> None:
        with self._lock:
            for conn in self._idle:
                conn.close()
            self._idle.clear()
