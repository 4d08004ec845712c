"""Loopback-only servers for the remote-storage tests, and their pytest fixtures: imported by
the test files as ``from servers import ...``. pytest sees a fixture in the test modules
that name it at module level: ``range_server = servers.range_server`` (an assignment rather
than an import, which ruff would call redefined by the test's argument of the same name).

* :class:`RangeServer` - a read-only HTTP/1.1 file server (GET, HEAD, single byte ranges) that
  records every request and injects faults (503, dropped connections, stalls) and throttling.
  Fixture: ``range_server`` (serves ``tmp_path``).
* :class:`GcsServer` - gcp-storage-emulator's Google Cloud Storage (JSON API, in memory) in a
  thread, read and written by gcsfs. Fixture: ``gcs_env`` (per test: a fresh server, a bucket
  ``ckpts``, and the settings that point ``gs://`` at it).
* :class:`S3Server` - moto's S3 in a thread. Fixtures: ``s3_server`` (session: starting moto
  costs a second or so), ``s3`` (per test: state reset, fake credentials, an s3fs filesystem)
  and ``s3_env`` (``s3`` plus the settings that point a plain ``fsspec.open("s3://...")`` at
  the server).

Everything binds to 127.0.0.1 on a port the OS picks, and is stopped, its threads joined, when
the fixture ends. What fsspec's http and s3 filesystems do on the wire, as seen through these
servers, is written down in tests/storage/test_servers.py.

Pointing ``s3://bucket/key`` at the server, with s3fs 2026.9 / botocore 1.43:

* ``client_kwargs={"endpoint_url": url}`` (or ``endpoint_url=url``) to ``S3FileSystem``, or as
  storage options to ``fsspec.open``/``fsspec.filesystem``: always works.
* ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) in the environment: works, read by
  botocore each time a client is made, so setting it in a test (monkeypatch) is enough.
* ``FSSPEC_S3_ENDPOINT_URL``: fsspec reads its ``FSSPEC_*`` variables into ``fsspec.config.conf``
  once, at import, so setting it in a running process does nothing; the in-process equivalent
  is ``fsspec.config.conf["s3"] = {"endpoint_url": url}`` (which ``s3_env`` sets as well).

fsspec caches filesystem instances, keyed by their arguments: one made against a server of an
earlier test would come back for the same arguments. The fixtures close and drop every cached
s3/http filesystem before and after each test (:func:`drop_cached_filesystems`).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import socket
import socketserver
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple

import pytest

__all__ = [
    "LOOPBACK",
    "FAULT_KINDS",
    "RangeServer",
    "Request",
    "S3",
    "S3Server",
    "drop_cached_filesystems",
    "fake_aws_env",
    "range_server",
    "s3",
    "s3_env",
    "s3_server",
    "s3fs_filesystem",
]

LOOPBACK = "127.0.0.1"
FAULT_KINDS = ("503", "403", "drop", "slow")
_CHUNK = 64 * 1024


class Request(NamedTuple):
    """One request as the server saw and answered it. ``sent`` counts body bytes only (not the
    status line and headers); ``status`` is None while no answer has begun; ``fault`` names
    the injected fault that answered it, if any."""

    method: str
    path: str
    range: str | None
    sent: int
    status: int | None
    fault: str | None = None


@dataclass
class _Entry:
    """A request's record while it is being answered: filled in before each piece of the
    answer goes out, so a client that has seen the answer always finds it recorded."""

    method: str
    path: str
    range: str | None
    sent: int = 0
    status: int | None = None
    fault: str | None = None

    def frozen(self) -> Request:
        return Request(self.method, self.path, self.range, self.sent, self.status, self.fault)


@dataclass
class _Fault:
    kind: str
    times: int
    match: str | None
    seconds: float


class _Stopped(Exception):
    """The server is stopping: a handler abandons what it is doing."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; every answer carries a Content-Length
    server_version = "RangeServer/1"
    timeout = 30  # an idle keep-alive connection gives up after this
    # TCP_NODELAY, as production servers set it: with Nagle's algorithm a small answer waits
    # ~40 ms for the client's delayed ACK, which would bill every ranged request 40 ms.
    disable_nagle_algorithm = True
    server: _HTTPServer

    def log_message(self, format, *args):  # quiet: no line per request
        pass

    def setup(self):
        super().setup()
        self.server.connections.add(self.connection)

    def finish(self):
        self.server.connections.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def do_GET(self):
        self._serve(body=True)

    def do_HEAD(self):
        self._serve(body=False)

    def _serve(self, body: bool):
        owner = self.server.owner
        path = urllib.parse.urlsplit(self.path).path
        rng = self.headers.get("Range")
        self._entry = entry = _Entry(self.command, path, rng)
        owner._record(entry)
        try:
            if owner._latency_s:
                owner._sleep(owner._latency_s)
            fault = owner._take_fault(path)
            if fault is not None:
                entry.fault = fault.kind
            moved = owner.redirects.get(path)
            if moved is not None:  # as a CDN or Hugging Face's resolve URLs answer
                self._answer(302, body, {"Location": moved})
            elif fault is not None and fault.kind == "503":
                self._answer(503, body, {"Retry-After": "0"})
            elif fault is not None and fault.kind == "403":  # a bucket's missing key, unlisted
                self._answer(403, body, {})
            elif fault is not None and fault.kind == "slow":
                owner._sleep(fault.seconds)
                self._file(path, rng, body, drop=False)
            else:
                self._file(path, rng, body, drop=fault is not None)
        except _Stopped:
            self.close_connection = True
        except OSError:  # the client went away mid-answer
            self.close_connection = True

    def _file(self, path: str, rng: str | None, body: bool, drop: bool):
        if self.server.owner.ignore_ranges:  # a server without range support: 200, whole
            rng = None
        target = self.server.owner._resolve(path)
        if target is None:
            self._answer(404, body)
            return
        with open(target, "rb") as f:  # streamed from the file: big files cost no memory
            size = os.fstat(f.fileno()).st_size
            span = _parse_range(rng, size) if rng is not None else None
            if span == "unsatisfiable":
                self._answer(416, body, {"Content-Range": f"bytes */{size}"})
            elif span is None:
                self._answer(200, body, length=size, source=f, drop=drop)
            else:
                start, stop = span
                f.seek(start)
                headers = {"Content-Range": f"bytes {start}-{stop - 1}/{size}"}
                self._answer(206, body, headers, length=stop - start, source=f, drop=drop)

    def _answer(self, status, body: bool, headers=None, length=0, source=None, drop=False):
        self._entry.status = status
        self.send_response(status)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(length))
        if status in (200, 206):
            self.send_header("Content-Type", "application/octet-stream")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if drop:  # the headers promise all of it; half comes, then the connection closes
            length //= 2
            self.close_connection = True
        if body and length:
            self._write(source, length)

    def _write(self, source, length: int):
        """``length`` bytes from ``source``, paced to the throttle's rate."""
        owner = self.server.owner
        rate = owner._bytes_per_s
        chunk = _CHUNK if not rate else max(1, min(_CHUNK, int(rate / 20)))
        began, done = time.monotonic(), 0
        while done < length:
            piece = source.read(min(chunk, length - done))
            if not piece:
                raise _Stopped  # the file shrank under us: cut the answer short
            self._entry.sent += len(piece)
            try:
                self.wfile.write(piece)
            except OSError:
                self._entry.sent -= len(piece)
                raise
            done += len(piece)
            if rate:
                owner._sleep(began + done / rate - time.monotonic())
        self.wfile.flush()


def _parse_range(header: str, size: int):
    """A single ``bytes=`` range as ``(start, stop)``; None when the header is to be ignored
    (malformed, another unit, several ranges: RFC 9110 lets a server answer 200 then), or
    ``"unsatisfiable"`` (answered 416)."""
    m = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header)
    if m is None or m[1] == m[2] == "":
        return None
    if m[1] == "":  # suffix: the last n bytes
        n = int(m[2])
        return "unsatisfiable" if n == 0 or size == 0 else (max(0, size - n), size)
    start = int(m[1])
    last = int(m[2]) if m[2] else None
    if last is not None and last < start:
        return None
    if start >= size:
        return "unsatisfiable"
    return start, size if last is None else min(last, size - 1) + 1


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = False  # handler threads are joined by server_close()
    block_on_close = True
    owner: RangeServer

    def server_bind(self):
        # HTTPServer.server_bind would ask for the host's fqdn (a DNS lookup); not needed
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = host, port

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], OSError):  # a client that hung up: not news
            return
        self.owner.errors.append(sys.exc_info()[1])
        super().handle_error(request, client_address)


class RangeServer:
    """A read-only HTTP/1.1 file server over ``root`` on 127.0.0.1 (port from the OS).

    GET and HEAD; a single ``Range: bytes=a-b``, ``bytes=a-`` or ``bytes=-n`` is answered 206
    with Content-Range, an unsatisfiable one 416 (``Content-Range: bytes */size``), anything
    else (several ranges, nonsense) is ignored: 200 with the whole file. Missing files and
    folders are 404. Every answer has Content-Length and ``Accept-Ranges: bytes``; connections
    are kept alive. Nothing is logged.

    Every request is recorded (:attr:`requests`, :attr:`bytes_sent`, :meth:`reset`); faults
    (:meth:`fail`) and throttling (:meth:`throttle`) shape the next answers. Use as a context
    manager, or :meth:`start` / :meth:`stop`.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()
        self.errors: list[BaseException] = []  # unexpected handler exceptions
        self.redirects: dict[str, str] = {}  # a path -> where a 302 sends it (a path or URL)
        self.ignore_ranges = False  # answer every GET 200 with the whole file
        self._lock = threading.Lock()
        self._records: list[_Entry] = []
        self._faults: list[_Fault] = []
        self._bytes_per_s: float | None = None
        self._latency_s = 0.0
        self._stopping = threading.Event()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # lifetime
    def start(self) -> RangeServer:
        httpd = _HTTPServer((LOOPBACK, 0), _Handler)
        httpd.owner = self
        httpd.connections = set()
        self._httpd = httpd
        self._stopping.clear()
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="RangeServer"
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, wake sleeping handlers, cut open connections, join every thread."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        self._stopping.set()
        httpd.shutdown()
        for conn in list(httpd.connections):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        httpd.server_close()  # joins the handler threads
        assert self._thread is not None
        self._thread.join()

    def __enter__(self) -> RangeServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # addresses
    @property
    def port(self) -> int:
        assert self._httpd is not None, "not started"
        return self._httpd.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def url(self, name: str) -> str:
        """``http://127.0.0.1:PORT/name`` (name relative to root, quoted)."""
        return f"{self.base_url}/{urllib.parse.quote(str(name).lstrip('/'))}"

    # records
    @property
    def requests(self) -> list[Request]:
        """The requests so far (a copy), in the order they came; one still being answered
        shows what has been sent of it."""
        with self._lock:
            return [e.frozen() for e in self._records]

    @property
    def bytes_sent(self) -> int:
        """Body bytes sent, all requests together."""
        with self._lock:
            return sum(r.sent for r in self._records)

    def reset(self) -> None:
        """Forget the recorded requests (faults and throttling stay)."""
        with self._lock:
            self._records.clear()

    # shaping
    def fail(
        self, kind: str, *, times: int = 1, match: str | None = None, seconds: float = 5.0
    ) -> None:
        """Answer the next ``times`` requests whose path contains ``match`` (None: any) badly.

        ``"503"``: 503 Service Unavailable (empty body, ``Retry-After: 0``). ``"403"``: 403
        Forbidden, as S3 and GCS answer for a missing key where listing is not allowed. ``"drop"``: the
        headers of the proper answer (its full Content-Length), half of its body, then the
        connection closes: a short read for the client. ``"slow"``: ``seconds`` of silence
        before the proper answer (make it longer than the client's timeout); stopping the
        server cuts the wait short. Faults queue up in the order given."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {kind!r}: one of {FAULT_KINDS}")
        with self._lock:
            self._faults.append(_Fault(kind, times, match, seconds))

    def throttle(self, bytes_per_s: float | None = None, latency_s: float = 0.0) -> None:
        """Wait ``latency_s`` before each answer and pace bodies to ``bytes_per_s`` (None:
        unthrottled). ``throttle()`` turns both off."""
        self._bytes_per_s = bytes_per_s
        self._latency_s = latency_s

    # for the handler
    def _take_fault(self, path: str) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.match is None or fault.match in path:
                    fault.times -= 1
                    if fault.times <= 0:
                        self._faults.remove(fault)
                    return fault
        return None

    def _record(self, entry: _Entry) -> None:
        with self._lock:
            self._records.append(entry)

    def _sleep(self, seconds: float) -> None:
        if seconds > 0 and self._stopping.wait(seconds):
            raise _Stopped

    def _resolve(self, url_path: str) -> Path | None:
        rel = posixpath.normpath("/" + urllib.parse.unquote(url_path)).lstrip("/")
        target = (self.root / rel).resolve()
        if not target.is_relative_to(self.root) or not target.is_file():
            return None
        return target


# S3 -------------------------------------------------------------------------------------------

_AWS_UNSET = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "FSSPEC_S3",
    "FSSPEC_S3_ENDPOINT_URL",
)
_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


def fake_aws_env(monkeypatch: pytest.MonkeyPatch, tmp_dir: str | os.PathLike | None = None):
    """Credentials that only moto accepts, and nothing of the real AWS set-up: no profile, no
    config or credentials file, no instance metadata, no proxy (so 127.0.0.1 is reached
    directly)."""
    for name in _AWS_UNSET + _PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    nowhere = os.path.join(tmp_dir or os.devnull, "no-aws-config")
    monkeypatch.setenv("AWS_CONFIG_FILE", nowhere)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", nowhere)
    monkeypatch.setenv("NO_PROXY", f"{LOOPBACK},localhost")
    monkeypatch.setenv("no_proxy", f"{LOOPBACK},localhost")


def s3fs_filesystem(endpoint_url: str, **kwargs):
    """A fresh (uncached) s3fs filesystem against ``endpoint_url``, with moto's credentials.
    Close it with ``drop_cached_filesystems(fs)`` (the fixtures do)."""
    import s3fs

    return s3fs.S3FileSystem(
        client_kwargs={"endpoint_url": endpoint_url},
        anon=False,
        key="testing",
        secret="testing",
        skip_instance_cache=True,
        **kwargs,
    )


def _close_filesystem(fs) -> None:
    """Close the aiohttp session behind an fsspec s3/http filesystem now, on its own loop,
    rather than whenever the garbage collector gets to it."""
    from fsspec.asyn import sync

    if getattr(fs, "_s3creator", None) is not None:  # s3fs
        creator, fs._s3creator, fs._s3 = fs._s3creator, None, None
        sync(fs.loop, creator.__aexit__, None, None, None)
    elif getattr(fs, "_session", None) is not None:  # HTTPFileSystem
        session, fs._session = fs._session, None
        sync(fs.loop, session.close)


def drop_cached_filesystems(*extra) -> None:
    """Close ``extra`` filesystems and every cached s3/http filesystem, empty fsspec's instance
    caches for them: no session left open, none pointed at a stopped server. (Sessions closed
    here need no garbage collection; any other is closed by fsspec's finalizer when collected,
    on fsspec's IO loop, which runs as long as the process does.)"""
    import fsspec

    classes = []
    for protocol in ("s3", "http", "gs"):
        with contextlib.suppress(ImportError, ValueError):
            classes.append(fsspec.get_filesystem_class(protocol))
    for fs in [*extra, *(fs for cls in classes for fs in list(cls._cache.values()))]:
        _close_filesystem(fs)
    for cls in classes:
        cls.clear_instance_cache()


class GcsServer:
    """gcp-storage-emulator on 127.0.0.1, port from the OS, objects in memory, with one bucket.

    gcsfs 2026 finds the server through ``STORAGE_EMULATOR_HOST`` (anonymous, plain HTTP).
    Its experimental zonal-bucket support (on by default) asks a gRPC control plane for each
    bucket's layout, which the emulator does not serve: 60 s of retries per bucket, then a
    fallback. ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``, read when gcsfs is imported, turns
    it off; tests/conftest.py sets it before any test file imports gcsfs."""

    def __init__(self, bucket: str = "ckpts"):
        self.bucket, self.endpoint_url, self._server = bucket, None, None
        self.errors: list[str] = []  # what the handlers raised, but a client hanging up

    def _handle_error(self, request, client_address) -> None:
        kind, error, _ = sys.exc_info()
        if not isinstance(error, (BrokenPipeError, ConnectionResetError)):
            self.errors.append(f"{kind.__name__ if kind else '?'}: {error}")

    def __enter__(self) -> GcsServer:
        from gcp_storage_emulator.server import create_server

        self._server = create_server(LOOPBACK, 0, in_memory=True, default_bucket=self.bucket)
        self._server.start()
        httpd = self._server._api._httpd
        httpd.handle_error = self._handle_error  # no traceback printed (CliRunner captures it)
        port = httpd.server_address[1]
        self.endpoint_url = f"http://{LOOPBACK}:{port}"
        return self

    def __exit__(self, *exc) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop()


class S3Server:
    """moto's S3 on 127.0.0.1, port from the OS; :meth:`reset` wipes every bucket (moto's
    ``POST /moto-api/reset``).

    The same server as ``moto.server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)``
    (moto's WSGI app in werkzeug's threaded server), set up here rather than through it for
    two things it does not let one choose: no log line per request (werkzeug's logger would
    print to stderr), and a single ``Server`` header (werkzeug adds its own beside moto's,
    which aiohttp's strict parser, the one used under ``python -X dev``, rejects as a 400).
    moto answers ``Connection: close``: every S3 request is a new connection.

    moto's state is per process: the in-process ``moto.mock_aws`` sees (and resets) the same
    buckets."""

    def __init__(self):
        self.endpoint_url: str | None = None
        self._httpd = None
        self._thread: threading.Thread | None = None

    def start(self) -> S3Server:
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import WSGIRequestHandler, make_server

        class Handler(WSGIRequestHandler):
            def log_request(self, code="-", size="-"):  # quiet (errors are still logged)
                pass

            def send_response(self, code, message=None):  # moto's Server header only
                self.log_request(code)
                self.send_response_only(code, message)
                self.send_header("Date", self.date_time_string())

        app = DomainDispatcherApplication(create_backend_app)
        self._httpd = make_server(LOOPBACK, 0, app, threaded=True, request_handler=Handler)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="S3Server"
        )
        self._thread.start()
        self.endpoint_url = f"http://{LOOPBACK}:{self._httpd.server_address[1]}"
        return self

    def stop(self) -> None:
        """Stop the server and join its thread (werkzeug's request threads are daemons, each
        ending with its connection, which moto closes after every answer)."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        assert self._thread is not None
        self._thread.join()
        self.endpoint_url = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def reset(self) -> None:
        assert self.endpoint_url is not None, "not started"
        no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        req = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        with no_proxy.open(req, timeout=10) as r:
            r.read()


@dataclass
class S3:
    """What the ``s3`` fixture yields: the server's address, an s3fs filesystem on it, and
    :meth:`bucket` / :meth:`client` helpers."""

    server: S3Server
    endpoint_url: str
    fs: object
    _clients: list = field(default_factory=list)

    def bucket(self, name: str) -> str:
        """Create bucket ``name`` (us-east-1, so no LocationConstraint); returns ``name``.
        The same by hand: ``fs.mkdir(name)``, or boto3's ``client.create_bucket(Bucket=name)``.
        """
        self.fs.mkdir(name)
        self.fs.invalidate_cache()
        return name

    def client(self):
        """A boto3 S3 client on the server (closed when the test ends)."""
        import boto3

        c = boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        self._clients.append(c)
        return c

    def close(self) -> None:
        for c in self._clients:
            c.close()
        self._clients.clear()
        drop_cached_filesystems(self.fs)


# fixtures -------------------------------------------------------------------------------------


@pytest.fixture
def range_server(tmp_path) -> Iterator[RangeServer]:
    """A :class:`RangeServer` over ``tmp_path``, stopped (threads joined) after the test; any
    cached http filesystem is closed and dropped before and after."""
    drop_cached_filesystems()
    with RangeServer(tmp_path) as server:
        yield server
    drop_cached_filesystems()
    assert not server.errors, server.errors


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server for the whole session (it takes a second or so to start)."""
    with S3Server() as server:
        yield server


@pytest.fixture
def s3(s3_server, monkeypatch, tmp_path) -> Iterator[S3]:
    """The session's moto server, emptied, with fake credentials in the environment (see
    :func:`fake_aws_env`) and a fresh s3fs filesystem on it. Cached s3/http filesystems are
    closed and dropped before and after; fsspec's own s3 settings are set aside."""
    import fsspec.config

    fake_aws_env(monkeypatch, tmp_path)
    monkeypatch.delitem(fsspec.config.conf, "s3", raising=False)  # FSSPEC_S3_* at import
    drop_cached_filesystems()
    s3_server.reset()
    env = S3(s3_server, s3_server.endpoint_url, s3fs_filesystem(s3_server.endpoint_url))
    try:
        yield env
    finally:
        env.close()


@pytest.fixture
def s3_env(s3, monkeypatch) -> S3:
    """``s3``, and ``s3://`` URLs opened with no storage options (``fsspec.open("s3://b/k")``)
    go to the server: sets ``AWS_ENDPOINT_URL`` (botocore reads it whenever a client is made)
    and fsspec's in-process config ``fsspec.config.conf["s3"]["endpoint_url"]`` (what
    ``FSSPEC_S3_ENDPOINT_URL`` becomes, read only when fsspec is imported)."""
    import fsspec.config

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)
    conf = {**fsspec.config.conf.get("s3", {}), "endpoint_url": s3.endpoint_url}
    monkeypatch.setitem(fsspec.config.conf, "s3", conf)
    return s3


@pytest.fixture
def gcs_env(monkeypatch) -> Iterator[GcsServer]:
    """A :class:`GcsServer` (bucket ``ckpts``) that ``gs://`` URLs go to; cached gs
    filesystems dropped before and after."""
    import gcsfs

    if gcsfs.GCSFileSystem.__name__ != "GCSFileSystem":  # imported with it on: see GcsServer
        pytest.fail("gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set")
    drop_cached_filesystems()
    with GcsServer() as server:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.endpoint_url)
        yield server
        drop_cached_filesystems()
    assert not server.errors, server.errors
