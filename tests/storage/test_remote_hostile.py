"""URLs held to the promises of local files against servers that lie, drip or run on (issue 30):
an answer that is not the range asked is refused, no body is read past what was asked, every
request has a total deadline, a length a server claims is bounded before its bytes are asked
for, and what a server says of sizes is checked where it is parsed.

The hostile server here serves one object from 127.0.0.1, each answer shaped by its ``mode``;
every loop it runs is bounded (by the object's size, a few seconds, or the fixture's stop)."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import servers
import torch
from helpers import one_error
from safetensors.torch import save_file

import ckptkit.storage.backends.base as remote_module
from ckptkit.storage.backends.base import RemoteError, byte_count
from ckptkit.storage.small import JSON_LIMIT

s3_server = servers.s3_server
s3 = servers.s3
s3_env = servers.s3_env

_PIECE = 64 * 1024
_DRIP_FOR_S = 3.0  # a dripping answer stops after this (a client without a deadline sees it end)


class Hostile:
    """One object of ``size`` bytes (``head``, then ``pad`` bytes) at ``url``, answered as
    ``mode`` says: ``honest``; ``shifted`` (a range past the first read answered from 4 bytes
    earlier, and a Content-Range that says so); ``longer`` (the range asked, then the rest of the
    object, Content-Length saying so); ``chunked`` (the same, chunked, without a length);
    ``drip`` (a byte every 10 ms); ``drip-headers`` (the status line and headers so);
    ``bad-length`` (a Content-Length that is no number); ``growing`` (each answer after the first
    gives a larger total). ``sent`` counts the body bytes written."""

    def __init__(self, head: bytes, size: int | None = None, mode: str = "honest") -> None:
        self.head, self.size = head, max(size or len(head), len(head))
        self.mode = mode
        self.sent = 0
        self.answers = 0
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.httpd = ThreadingHTTPServer((servers.LOOPBACK, 0), _handler(self))
        self.httpd.daemon_threads = False
        self.httpd.block_on_close = True
        self.connections: set[socket.socket] = set()
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,))

    def url(self, name: str) -> str:
        return f"http://{servers.LOOPBACK}:{self.httpd.server_address[1]}/{name}"

    def bytes(self, start: int, end: int) -> bytes:
        """The object's bytes ``[start, end)``."""
        inside = self.head[start:end]
        return inside + b" " * (max(0, end - start) - len(inside))

    def stop(self) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        for conn in list(self.connections):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self.httpd.server_close()
        self.thread.join()


def _handler(server: Hostile) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 10

        def log_message(self, *args):
            pass

        def setup(self):
            super().setup()
            server.connections.add(self.connection)

        def finish(self):
            server.connections.discard(self.connection)
            with contextlib.suppress(OSError):
                super().finish()

        def do_GET(self):
            with contextlib.suppress(OSError):
                self._answer()
            self.close_connection = True

        def _answer(self):
            with server.lock:
                server.answers += 1
                count = server.answers
            size, mode = server.size, server.mode
            first, _, last = self.headers["Range"].removeprefix("bytes=").partition("-")
            start, end = int(first), min(int(last) + 1, size)
            if mode == "shifted" and start > 0:  # as many bytes, from 4 bytes earlier
                start, end = start - 4, end - 4
            total = size + count if mode == "growing" and count > 1 else size
            if mode in ("longer", "chunked"):
                body_end = size
            else:
                body_end = end
            if mode == "drip-headers":
                self._drip(f"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {start}-")
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{total}")
            if mode == "chunked":
                self.send_header("Transfer-Encoding", "chunked")
            elif mode == "bad-length":
                self.send_header("Content-Length", f"{end - start}abc")
            else:
                self.send_header("Content-Length", str(body_end - start))
            self.end_headers()
            if mode == "drip":
                self._drip(server.bytes(start, body_end).decode("latin-1"))
                return
            at = start
            while at < body_end and not server.stopping.is_set():
                piece = server.bytes(at, min(at + _PIECE, body_end))
                if mode == "chunked":
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                else:
                    self.wfile.write(piece)
                with server.lock:
                    server.sent += len(piece)
                at += len(piece)
            if mode == "chunked":
                self.wfile.write(b"0\r\n\r\n")

        def _drip(self, text: str):
            """A byte every 10 ms, for a few seconds at most."""
            began = time.monotonic()
            for char in text.encode("latin-1"):
                if time.monotonic() - began > _DRIP_FOR_S or server.stopping.wait(0.01):
                    return
                self.wfile.write(bytes([char]))
                self.wfile.flush()
                with server.lock:
                    server.sent += 1

    return Handler


@pytest.fixture
def hostile():
    """``hostile(head, size=None, mode="honest")``: a started :class:`Hostile`, stopped after."""
    started: list[Hostile] = []

    def start(head: bytes, size: int | None = None, mode: str = "honest") -> Hostile:
        server = Hostile(head, size, mode)
        server.thread.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def two_tries(monkeypatch):
    """Two tries, no wait between them: a refusal comes after the retries, quickly."""
    monkeypatch.setattr(remote_module, "TRIES", 2)
    monkeypatch.setattr(remote_module, "BACKOFF_S", 0.0)


def _safetensors(tmp_path) -> bytes:
    """A 2 MiB safetensors file: its tensors lie past the first read (256 KiB)."""
    state = {f"w{i}": torch.arange(128 * 1024, dtype=torch.float32) + i for i in range(4)}
    save_file(state, tmp_path / "m.safetensors")
    return (tmp_path / "m.safetensors").read_bytes()


# --- answers that are not the range asked -------------------------------------------------------


def test_a_range_answered_from_another_offset_is_refused_not_verified(
    tmp_path, hostile, run, two_tries
):
    server = hostile(_safetensors(tmp_path), mode="shifted")
    url = server.url("m.safetensors")
    line = one_error(run("convert", url, "out.safetensors"), url, "after 2 tries")
    assert "the server answered 'bytes " in line
    assert not (tmp_path / "out.safetensors").exists()


def test_an_honest_server_of_the_same_file_converts_as_the_local_file(tmp_path, hostile, run):
    # the server itself is sound: what the tests above refuse is its lie alone
    server = hostile(_safetensors(tmp_path))
    result = run("convert", server.url("m.safetensors"), "remote.safetensors")
    assert result.exit_code == 0, result.stderr
    assert run("convert", "m.safetensors", "local.safetensors").exit_code == 0
    assert (tmp_path / "remote.safetensors").read_bytes() == (
        tmp_path / "local.safetensors"
    ).read_bytes()


def test_a_size_that_changes_between_answers_is_refused(tmp_path, hostile, run, two_tries):
    server = hostile(_safetensors(tmp_path), mode="growing")
    url = server.url("m.safetensors")
    one_error(run("convert", url, "out.safetensors"), url, "the server answered")
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("mode", ["longer", "chunked"])
def test_a_body_past_the_range_asked_is_not_read(tmp_path, hostile, run, two_tries, mode):
    # 64 MiB of object after a range of 256 KiB: read, it would all be held in memory
    server = hostile(_safetensors(tmp_path), size=64 << 20, mode=mode)
    url = server.url("m.safetensors")
    line = one_error(run("inspect", url), url)
    assert "Content-Length" in line or "more than the 262144 bytes asked for" in line
    assert server.sent < 16 << 20  # what the sockets' buffers took, not the body


def test_a_content_length_that_is_no_number_is_one_error(tmp_path, hostile, run):
    server = hostile(_safetensors(tmp_path), mode="bad-length")
    url = server.url("m.safetensors")
    one_error(run("inspect", url), url, "Content-Length is not a byte count ('262144abc')")


# --- deadlines --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["drip", "drip-headers"])
def test_a_dripping_server_meets_the_deadline(tmp_path, hostile, run, two_tries, monkeypatch, mode):
    monkeypatch.setenv("CKPTKIT_REMOTE_DEADLINE", "0.2")
    monkeypatch.setenv("CKPTKIT_REMOTE_MIN_RATE", str(1 << 30))
    server = hostile(_safetensors(tmp_path), mode=mode)
    url = server.url("m.safetensors")
    line = one_error(run("inspect", url), url, "no whole answer within 0.2 s")
    assert "CKPTKIT_REMOTE_DEADLINE" in line
    assert server.sent < _DRIP_FOR_S / 0.01  # cut before the drip ran out


def test_the_deadline_grows_with_the_bytes_asked(monkeypatch):
    monkeypatch.setenv("CKPTKIT_REMOTE_DEADLINE", "10")
    monkeypatch.setenv("CKPTKIT_REMOTE_MIN_RATE", "1000")
    assert remote_module.deadline_s(5000) == 15.0
    monkeypatch.setenv("CKPTKIT_REMOTE_DEADLINE", "nan")  # not a number: the default
    monkeypatch.delenv("CKPTKIT_REMOTE_MIN_RATE")
    assert remote_module.deadline_s(0) == remote_module.DEADLINE_S
    monkeypatch.setenv("CKPTKIT_REMOTE_DEADLINE", "1e300")  # a timer cannot wait that long
    assert remote_module.deadline_s(0) == 7 * 24 * 3600


# --- lengths bounded before their bytes are asked for -----------------------------------------


def test_a_huge_sharded_index_at_a_url_is_refused_unread(hostile, run):
    text = json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}).encode()
    server = hostile(text, size=JSON_LIMIT + 1)
    url = server.url("model.safetensors.index.json")
    one_error(run("inspect", url), url, "too large for a shard index")
    assert server.sent <= 256 * 1024  # the first read, which told the size


def test_a_sharded_index_nested_deep_at_a_url_is_one_error(hostile, run):
    server = hostile(b'{"weight_map": {}, "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    url = server.url("model.safetensors.index.json")
    one_error(run("inspect", url), url, "deep")


@pytest.mark.parametrize("metadata", ["5", '"text"', "[1, 2]"])
def test_a_sharded_index_whose_metadata_is_no_mapping_is_one_error(hostile, run, metadata):
    text = b'{"weight_map": {"w": "m.safetensors"}, "metadata": ' + metadata.encode() + b"}"
    url = hostile(text).url("model.safetensors.index.json")
    one_error(run("inspect", url), url, "metadata")


def test_a_dcp_sharding_check_of_a_url_folder_reads_no_header_past_its_file(s3_env, run):
    # a folder of safetensors without an index: each file's header is read to tell a DCP
    # save (its chunks' offsets in the header) from a plain folder
    bucket = s3_env.bucket("ckpts")
    head = struct.pack("<Q", 90_000_000) + b"{" + b" " * 100
    s3_env.fs.pipe(f"{bucket}/folder/model.safetensors", head + b" " * (3 << 20))
    from ckptkit.formats.folders.layouts import find_dcp
    from ckptkit.storage.backends.base import counting
    from ckptkit.storage.remote import RemotePath

    with counting() as traffic:
        assert find_dcp(RemotePath(f"s3://{bucket}/folder")) is None
    assert traffic.bytes <= 256 * 1024  # the first read only, not the 3 MiB file


def test_a_local_dcp_sharding_check_reads_no_header_the_format_rules_out(tmp_path):
    import tracemalloc

    from ckptkit.formats.files.safetensors import dcp_sharding_info

    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:  # 150 MB, sparse: a header length of 2**40 claimed
        f.write(struct.pack("<Q", 1 << 40) + b'{"__metadata__": {"DCP_SHARDING_INFO": "{}"}}')
        f.truncate(150_000_000)
    tracing = tracemalloc.is_tracing()
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        assert dcp_sharding_info(path) is None
        peak = tracemalloc.get_traced_memory()[1] - tracemalloc.get_traced_memory()[0]
    finally:
        if not tracing:
            tracemalloc.stop()
    assert peak < 1 << 20  # not the 100 MB the check read before


# --- numbers a server claims -------------------------------------------------------------------


@pytest.mark.parametrize("value", [-1, 1.5, "12", None, True, float("nan")])
def test_a_claimed_size_that_is_no_byte_count_is_refused(value):
    with pytest.raises(RemoteError, match="the listing's size of x is not a byte count"):
        byte_count(value, "the listing's size of x")


# --- plot of a run at a URL ---------------------------------------------------------------------


def _put_run(s3_env, folder: str, losses: list[float]) -> None:
    steps = "".join(
        json.dumps({"step": i, "loss": v, "lr": 0.1}) + "\n" for i, v in enumerate(losses)
    )
    epochs = json.dumps({"step": len(losses), "val_loss": losses[-1], "world_size": 2}) + "\n"
    s3_env.fs.pipe(f"{folder}/steps.jsonl", (steps + '{"step": 9, "lo').encode())  # torn
    s3_env.fs.pipe(f"{folder}/metrics.jsonl", (epochs + "[" * 10_000 + "\n").encode())


def test_plot_reads_runs_at_s3_urls(s3_env, run, tmp_path):
    pytest.importorskip("matplotlib")
    bucket = s3_env.bucket("ckpts")
    _put_run(s3_env, f"{bucket}/runs/a", [3.0, 2.0, 1.0])
    _put_run(s3_env, f"{bucket}/runs/b", [4.0, 1.0])
    result = run("plot", f"s3://{bucket}/runs/a", f"s3://{bucket}/runs/b", "-o", "c.png", "--json")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    from ckptkit.plot import read_curves, run_names

    assert run_names([f"s3://{bucket}/runs/a", f"s3://{bucket}/x/a"]) == ["runs/a", "x/a"]
    curves = read_curves(f"s3://{bucket}/runs/a", "a")
    assert curves.points("loss") == [(0.0, 3.0), (1.0, 2.0), (2.0, 1.0)]  # the torn line skipped
    assert curves.val_points("loss") == [(3.0, 1.0)] and curves.world_size == 2


def test_plot_of_a_missing_url_or_to_a_url_is_one_error(s3_env, run):
    pytest.importorskip("matplotlib")
    bucket = s3_env.bucket("ckpts")
    one_error(run("plot", f"s3://{bucket}/nope", "-o", "c.png"), f"s3://{bucket}/nope")
    _put_run(s3_env, f"{bucket}/runs/a", [1.0])
    one_error(run("plot", f"s3://{bucket}/runs/a", "-o", f"s3://{bucket}/c.png"), "local path")


def test_a_redirect_from_https_to_plain_http_is_refused():
    from ckptkit.storage.backends.http import HttpRemote

    remote = HttpRemote("https://127.0.0.1:1/m.safetensors")  # no request made yet
    with pytest.raises(RemoteError, match="redirects from https to plain http"):
        remote._locate("http://127.0.0.1:1/m.safetensors")


def test_a_folder_at_a_url_probed_as_a_file_is_no_file(s3_env):
    # what an adapter's base next to it (adapter.parent / name) is looked up by
    from ckptkit.storage.remote import RemotePath

    bucket = s3_env.bucket("ckpts")
    s3_env.fs.pipe(f"{bucket}/base/model.safetensors", b"x")
    folder = RemotePath(f"s3://{bucket}/base")
    assert not folder.is_file() and folder.exists() and folder.is_dir()
