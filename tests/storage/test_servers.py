"""The loopback servers of servers.py, checked with real clients (urllib, http.client, fsspec's
http filesystem, s3fs, boto3); and what those clients do on the wire, written down for the
remote-storage tests to come.

Observed with fsspec 2026.9 / aiohttp 3.14 (``fs = fsspec.filesystem("http")``), in requests:

* ``fs.cat_file(url, start, end)``: one ``GET`` with ``Range: bytes=start-(end-1)``, no HEAD.
  ``fs.cat_file(url, -n)``: one GET ``bytes=-n`` (a suffix range); a negative ``end`` costs a
  HEAD first (for the size). ``fs.cat_file(url, start)``: one GET ``bytes=start-``.
  ``fs.cat(url)``: one plain GET. ``fs.info(url)``: one HEAD.
* ``fs.open(url)`` makes a HEAD (the size); then ``read(n)`` from offset ``p`` makes one GET
  ``bytes=p-(p+n+block_size-1)`` (clipped to the file): it reads ahead a whole block, 5 MiB by
  default (``block_size=``, ``cache_type="bytes"``); later reads inside that span cost nothing.
  ``cache_type="none"`` reads exactly ``n``. ``read()`` of everything from 0 is a plain GET.
  ``block_size=0`` streams one plain GET (the client hangs up when closed).
* A 503 raises ``aiohttp.ClientResponseError`` (``.status == 503``), a dropped connection
  ``aiohttp.ClientPayloadError``, a stall past the client's timeout
  ``fsspec.exceptions.FSTimeoutError``; none is retried. aiohttp's timeout goes in
  ``client_kwargs={"timeout": aiohttp.ClientTimeout(...)}``: ``timeout=`` to a call is
  fsspec's own limit on waiting for it (a float; a ClientTimeout there is a TypeError that
  leaves a coroutine never awaited, a RuntimeWarning).
* ``fsspec.open(url)`` and reading from it: as ``fs.open``.

s3fs 2026.9 (seen through botocore's ``before-send`` event): ``fs.cat_file(path, start=,
end=)`` (keywords: the second positional is ``version_id``) is one ranged GetObject, no
HeadObject; ``fs.cat(path)`` a HeadObject and a plain GetObject. ``fs.open(path)`` costs a
HeadObject, then ``read(n)`` one GetObject of ``n + block_size`` bytes (clipped to the
object): 50 MiB by default (``default_block_size``, ``cache_type="readahead"``); with
``cache_type="none"`` exactly ``n``. ``put``/``get`` list the key as a folder first (a
ListObjectsV2), then one PutObject/GetObject (below the multipart size, 50 MiB). moto closes
the connection after each answer.

Warnings (none arise here under ``filterwarnings = error``, nor under ``python -X dev``):
fsspec's http and s3 filesystems hold aiohttp sessions, which fsspec closes from a finalizer
when the filesystem is collected (on its IO loop, alive as long as the process); but a cached
filesystem is never collected. ``drop_cached_filesystems()`` closes them now and empties the
instance caches; the fixtures call it before and after each test. A boto3 client is closed
with ``client.close()`` (``S3.client()`` does it); urllib responses and HTTPErrors with
``with``.
"""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request

import aiohttp
import fsspec
import fsspec.config
import pytest
import s3fs
import servers
from fsspec.exceptions import FSTimeoutError
from servers import RangeServer

# the fixtures, made visible to pytest here (assigned rather than imported: an imported name
# that a test's argument shadows is a redefinition to ruff)
range_server = servers.range_server
s3_server = servers.s3_server
s3 = servers.s3
s3_env = servers.s3_env

DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
DATA = bytes(range(256)) * 40  # 10240 bytes


def get(url, range=None, method="GET", timeout=5):
    req = urllib.request.Request(url, method=method)
    if range is not None:
        req.add_header("Range", range)
    try:
        with DIRECT.open(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, dict(e.headers), e.read()


@pytest.fixture
def served(range_server, tmp_path):
    (tmp_path / "a.bin").write_bytes(DATA)
    (tmp_path / "b.bin").write_bytes(DATA)
    (tmp_path / "sub").mkdir()
    return range_server


# RangeServer ----------------------------------------------------------------------------------


RANGE_CASES = [
    (None, 200, DATA, None),
    ("bytes=10-19", 206, DATA[10:20], "bytes 10-19/10240"),
    ("bytes=10240-", 416, b"", "bytes */10240"),
    ("bytes=10000-", 206, DATA[10000:], "bytes 10000-10239/10240"),
    ("bytes=10000-99999", 206, DATA[10000:], "bytes 10000-10239/10240"),
    ("bytes=-7", 206, DATA[-7:], "bytes 10233-10239/10240"),
    ("bytes=-99999", 206, DATA, "bytes 0-10239/10240"),
    ("bytes=-0", 416, b"", "bytes */10240"),
    ("bytes=0-0,5-9", 200, DATA, None),  # several ranges: ignored
    ("bytes=9-3", 200, DATA, None),  # malformed: ignored
]


@pytest.mark.parametrize(
    ("header", "status", "body", "content_range"), RANGE_CASES, ids=[str(c[0]) for c in RANGE_CASES]
)
def test_ranges(served, header, status, body, content_range):
    got_status, headers, got = get(served.url("a.bin"), header)
    assert (got_status, got) == (status, body)
    assert headers.get("Content-Range") == content_range
    assert headers["Content-Length"] == str(len(body))
    assert headers["Accept-Ranges"] == "bytes"


def test_head_missing_and_outside(served):
    status, headers, body = get(served.url("a.bin"), method="HEAD")
    assert (status, headers["Content-Length"], body) == (200, "10240", b"")
    assert get(served.url("nope.bin"))[0] == 404
    assert get(served.url("sub"))[0] == 404  # folders are not served
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=5)
    conn.request("GET", f"/../{served.root.name}/a.bin")  # sent as is: no way out of the root
    r = conn.getresponse()
    assert (r.status, r.read()) == (404, b"")
    conn.close()


def test_keep_alive_and_records(served):
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=5)
    conn.request("GET", "/a.bin", headers={"Range": "bytes=0-99"})
    r = conn.getresponse()
    assert (r.status, len(r.read()), r.will_close) == (206, 100, False)
    sock = conn.sock
    conn.request("HEAD", "/b.bin")
    r = conn.getresponse()
    r.read()
    assert conn.sock is sock  # the same connection served both
    conn.close()
    assert [tuple(q) for q in served.requests] == [
        ("GET", "/a.bin", "bytes=0-99", 100, 206, None),
        ("HEAD", "/b.bin", None, 0, 200, None),
    ]
    assert served.bytes_sent == 100
    served.reset()
    assert (served.requests, served.bytes_sent) == ([], 0)
    assert served.url("x y.bin") == f"http://127.0.0.1:{served.port}/x%20y.bin"


def test_fault_503_times_and_match(served):
    served.fail("503", times=2, match="b.bin")
    assert get(served.url("a.bin"))[0] == 200  # not matched: untouched
    status, headers, _ = get(served.url("b.bin"))
    assert (status, headers["Retry-After"]) == (503, "0")
    assert get(served.url("b.bin"))[0] == 503
    assert get(served.url("b.bin"))[0] == 200  # both used up
    assert [(q.status, q.fault) for q in served.requests] == [
        (200, None),
        (503, "503"),
        (503, "503"),
        (200, None),
    ]


def test_fault_drop_is_a_short_read(served):
    served.fail("drop")
    with DIRECT.open(served.url("a.bin"), timeout=5) as r:
        assert r.headers["Content-Length"] == "10240"
        with pytest.raises(http.client.IncompleteRead) as e:
            r.read()
    assert len(e.value.partial) == 5120
    assert served.requests[0][3:] == (5120, 200, "drop")
    assert get(served.url("a.bin"))[2] == DATA  # once only


def test_fault_slow_outlasts_the_client_timeout(served):
    served.fail("slow", seconds=3)
    began = time.monotonic()
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        get(served.url("a.bin"), timeout=0.2)
    assert time.monotonic() - began < 2
    assert get(served.url("a.bin"))[2] == DATA  # other requests are answered meanwhile
    # the stalled handler is still asleep: stopping the server wakes it (teardown stays fast)


def test_throttle_lower_bounds(range_server, tmp_path):
    (tmp_path / "mb.bin").write_bytes(bytes(1_000_000))
    range_server.throttle(bytes_per_s=4_000_000)
    began = time.monotonic()
    assert len(get(range_server.url("mb.bin"))[2]) == 1_000_000
    assert time.monotonic() - began >= 0.2  # 0.25 s at 4 MB/s
    range_server.throttle(latency_s=0.1)
    began = time.monotonic()
    get(range_server.url("mb.bin"), "bytes=0-0")
    get(range_server.url("mb.bin"), method="HEAD")
    assert time.monotonic() - began >= 0.2


# fsspec's http filesystem against RangeServer -------------------------------------------------


def test_fsspec_http_requests(range_server, tmp_path):
    """What fsspec's http filesystem sends; see the module docstring."""
    blob = os.urandom(6 * 2**20)
    (tmp_path / "big.bin").write_bytes(blob)
    url = range_server.url("big.bin")
    fs = fsspec.filesystem("http")

    def seen(action):
        range_server.reset()
        result = action()
        return result, [(q.method, q.range) for q in range_server.requests]

    assert seen(lambda: fs.cat_file(url, 10, 20)) == (blob[10:20], [("GET", "bytes=10-19")])
    assert seen(lambda: fs.cat_file(url, -5)) == (blob[-5:], [("GET", "bytes=-5")])
    assert seen(lambda: fs.cat_file(url, -10, -5))[1] == [
        ("HEAD", None),
        ("GET", "bytes=6291446-6291450"),
    ]

    def read(n, **kw):
        with fs.open(url, **kw) as f:
            return f.read(n), f.read(n)

    # 100 bytes asked for, 100 + 5 MiB fetched; the second read comes from that
    assert seen(lambda: read(100)) == (
        (blob[:100], blob[100:200]),
        [("HEAD", None), ("GET", f"bytes=0-{100 + 5 * 2**20 - 1}")],
    )
    assert seen(lambda: read(100, cache_type="none"))[1] == [
        ("HEAD", None),
        ("GET", "bytes=0-99"),
        ("GET", "bytes=100-199"),
    ]


def test_fsspec_http_faults(range_server, tmp_path):
    (tmp_path / "a.bin").write_bytes(DATA)
    url = range_server.url("a.bin")
    fs = fsspec.filesystem("http")
    range_server.fail("503")
    with pytest.raises(aiohttp.ClientResponseError) as e:
        fs.cat_file(url, 0, 100)
    assert e.value.status == 503
    range_server.fail("drop")
    with pytest.raises(aiohttp.ClientPayloadError):
        fs.cat_file(url, 0, 100)
    range_server.fail("slow", seconds=3)
    # aiohttp's timeout goes in client_kwargs: ``timeout=`` to a call is fsspec's own (it
    # abandons the call, leaving a coroutine never awaited: a RuntimeWarning)
    impatient = fsspec.filesystem("http", client_kwargs={"timeout": aiohttp.ClientTimeout(0.2)})
    with pytest.raises(FSTimeoutError):
        impatient.cat_file(url, 0, 100)
    assert fs.cat_file(url, 0, 100) == DATA[:100]
    assert len(range_server.requests) == 4  # nothing retried


# S3 (moto) ------------------------------------------------------------------------------------


def test_s3fs_put_get_cat(s3, tmp_path):
    assert s3.fs.ls("") == []  # every test starts with no buckets
    assert not s3fs.S3FileSystem._cache  # nor a cached filesystem
    s3.bucket("ckpt")
    src = tmp_path / "w.bin"
    src.write_bytes(DATA)
    s3.fs.put(str(src), "ckpt/run/w.bin")
    s3.fs.get("ckpt/run/w.bin", str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == DATA
    assert s3.fs.cat_file("ckpt/run/w.bin", start=100, end=110) == DATA[100:110]
    assert s3.fs.cat_file("ckpt/run/w.bin", start=-3) == DATA[-3:]
    assert s3.fs.size("ckpt/run/w.bin") == len(DATA)
    body = s3.client().get_object(Bucket="ckpt", Key="run/w.bin", Range="bytes=0-3")["Body"]
    with body:
        assert body.read() == DATA[:4]


def test_s3fs_requests(s3):
    """What s3fs sends (see the module docstring), seen through botocore's before-send event."""
    s3.bucket("ckpt")
    s3.fs.pipe_file("ckpt/k", DATA)
    sent = []

    def hook(request, **kwargs):
        sent.append((request.method, request.headers.get("Range")))

    s3.fs.s3.meta.events.register("before-send.s3", hook)
    assert s3.fs.cat_file("ckpt/k", start=10, end=20) == DATA[10:20]
    assert sent == [("GET", b"bytes=10-19")]
    sent.clear()
    with s3.fs.open("ckpt/k", block_size=1000) as f:
        assert f.read(100) == DATA[:100]
        assert f.read(100) == DATA[100:200]
    assert sent == [("HEAD", None), ("GET", b"bytes=0-1099")]


def test_reset_forgets_buckets(s3, s3_server):
    s3.bucket("ckpt")
    assert s3.fs.ls("") == ["ckpt"]
    s3_server.reset()
    s3.fs.invalidate_cache()
    assert s3.fs.ls("") == []


def test_plain_fsspec_open_with_s3_env(s3_env):
    s3_env.bucket("ckpt")
    with fsspec.open("s3://ckpt/k", "wb") as f:
        f.write(DATA)
    with fsspec.open("s3://ckpt/k", "rb") as f:
        assert f.read() == DATA
    assert s3_env.fs.cat_file("ckpt/k") == DATA  # the same server


@pytest.mark.parametrize("how", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "fsspec.config"])
def test_each_endpoint_setting_alone(s3, monkeypatch, how):
    s3.bucket("ckpt")
    s3.fs.pipe_file("ckpt/k", b"here")
    if how == "fsspec.config":
        monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": s3.endpoint_url})
    else:
        monkeypatch.setenv(how, s3.endpoint_url)
    with fsspec.open("s3://ckpt/k", "rb") as f:
        assert f.read() == b"here"


def test_fsspec_env_var_is_read_at_import_only(s3, monkeypatch):
    """``FSSPEC_S3_ENDPOINT_URL`` set in a running process changes nothing (no request made:
    it would go to AWS); set before a process starts, it works."""
    monkeypatch.setenv("FSSPEC_S3_ENDPOINT_URL", s3.endpoint_url)
    fs, _ = fsspec.core.url_to_fs("s3://ckpt/k")
    assert fs.endpoint_url is None and "endpoint_url" not in fs.client_kwargs
    s3.bucket("ckpt")
    s3.fs.pipe_file("ckpt/k", b"here")
    script = textwrap.dedent(
        """
        import sys, fsspec
        fs, _ = fsspec.core.url_to_fs("s3://ckpt/k")
        if fs.endpoint_url != sys.argv[1]:  # never a request to AWS
            sys.exit("endpoint not taken")
        print(fs.cat_file("ckpt/k").decode())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, s3.endpoint_url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "here"


def test_servers_stop_cleanly(tmp_path):
    server = RangeServer(tmp_path).start()
    (tmp_path / "a.bin").write_bytes(DATA)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    conn.request("GET", "/a.bin")
    conn.getresponse().read()  # the connection stays open, its handler thread waiting
    server.fail("slow", seconds=30)
    slow = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    slow.request("GET", "/a.bin")  # a handler asleep for 30 s
    time.sleep(0.1)
    port = server.port
    began = time.monotonic()
    server.stop()
    assert time.monotonic() - began < 2
    conn.close()
    slow.close()
    assert [t for t in threading.enumerate() if t.name == "RangeServer"] == []
    with pytest.raises(OSError):
        get(f"http://127.0.0.1:{port}/a.bin", timeout=1)
