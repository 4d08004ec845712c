"""Checkpoints at URLs: read with ranged requests against real servers on 127.0.0.1 (the range
HTTP server of servers.py, moto's S3 through s3fs) and fsspec's memory:// file system; requests
and bytes counted by the servers themselves; faults injected by the server."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import servers
import torch
from helpers import FIXTURE_DIR, ROOT, one_error, single_process_dcp
from safetensors.torch import load_file, save_file

import ckptkit
import ckptkit.storage.backends.base as remote_module
from ckptkit.errors import CkptkitError, UsageError
from ckptkit.storage.backends import open_remote
from ckptkit.storage.location import location
from ckptkit.storage.rangefile import RangeFile
from ckptkit.storage.remote import RemotePath, is_url

range_server = servers.range_server
s3_server = servers.s3_server
s3 = servers.s3
s3_env = servers.s3_env

STATE = {
    f"module.layers.{i}.{name}": torch.randn(64, 64, generator=torch.Generator().manual_seed(i)).to(
        dtype
    )
    for i in range(24)
    for name, dtype in (("w.weight", torch.float32), ("v.weight", torch.bfloat16))
}


@pytest.fixture
def files(tmp_path):
    """The same tensors as safetensors, as a training checkpoint (torch zip), and DDP-style."""
    save_file(STATE, tmp_path / "m.safetensors", metadata={"format": "pt"})
    torch.save({"model": STATE, "epoch": 3}, tmp_path / "m.pt")
    return tmp_path


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(remote_module, "BACKOFF_S", 0.01)


def grown_in_a_child(imports: str, body: str, *args: object) -> tuple[str, float]:
    """Run ``body`` after ``import {imports}`` in a child (``sys.argv[1:]`` = ``args``): what it
    printed, and how many MB its peak RSS grew past a child that only imports the same."""
    peak = "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    base = subprocess.run(
        [sys.executable, "-c", f"import resource, {imports}\n{peak}"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", f"import resource, sys, {imports}\n{body}\n{peak}", *map(str, args)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    printed, _, last = done.stdout.rstrip("\n").rpartition("\n")
    return printed, (int(last) - int(base.stdout)) / 1024


# ------------------------------------------------------------------------------ URLs


def test_a_url_stands_where_a_path_would():
    url = RemotePath("s3://bucket/run/model.safetensors")
    assert (url.name, url.suffix, url.scheme) == ("model.safetensors", ".safetensors", "s3")
    assert str(url.parent) == "s3://bucket/run" and str(url.parent / "x.json") == (
        "s3://bucket/run/x.json"
    )
    assert is_url("https://h/x.pt") and is_url("memory://a") and not is_url("a/b.pt")
    assert not is_url("C:/x.pt") and str(location("s3://b/k")) == "s3://b/k"
    assert isinstance(location("s3://b/k"), RemotePath) and location("C:/x.pt") == Path("C:/x.pt")
    assert not hasattr(url, "__fspath__")  # never opened as a local file by mistake


def test_a_missing_back_end_names_its_extra(run):
    # adlfs is not in the test extra: the scheme's extra is named, nothing else is tried
    try:
        import adlfs  # noqa: F401

        pytest.skip("adlfs is installed")
    except ImportError:
        pass
    one_error(run("inspect", "az://container/model.safetensors"), "torch-ckptkit[azure]")


# -------------------------------------------------------------------- over HTTP


def test_inspect_of_a_safetensors_url_is_one_request(files, range_server, run):
    result = run("inspect", range_server.url("m.safetensors"), "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    local = ckptkit.summarize(files / "m.safetensors").to_dict()
    assert doc["tensors"] == local["tensors"] and doc["file_size"] == local["file_size"]
    assert doc["safety"]["verdict"] == "safe"
    requests = range_server.requests
    assert len(requests) == 1 and requests[0].range == "bytes=0-262143"  # header inside
    assert doc["fetched"] == {"requests": 1, "bytes": range_server.bytes_sent}


def test_a_header_past_the_first_read_costs_a_second_request(tmp_path, range_server):
    many = {f"block.{i}.weight": torch.zeros(1) for i in range(6000)}  # a 300 kB header
    save_file(many, tmp_path / "wide.safetensors")
    summary = ckptkit.summarize(range_server.url("wide.safetensors"))
    assert len(summary.tensors) == 6000
    assert len(range_server.requests) == 2 and summary.fetched["requests"] == 2


def test_inspect_and_scan_of_a_torch_zip_url_are_two_requests(files, range_server, run):
    result = run("inspect", range_server.url("m.pt"))
    assert result.exit_code == 0, result.stderr
    assert "state dict  'model'" in result.stdout and "safe:" in result.stdout
    assert "fetched     2 requests" in result.stdout
    size = (files / "m.pt").stat().st_size
    requests = range_server.requests
    assert len(requests) == 2 and requests[1].range.endswith(f"-{size - 1}")  # the directory
    range_server.reset()
    result = run("scan", range_server.url("m.pt"), "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["verdict"] == "safe"
    assert len(range_server.requests) == 2
    # the headers are a small part of a file of tensors
    assert range_server.bytes_sent < size


def test_a_small_torch_zip_is_one_request(tmp_path, range_server):
    torch.save({"w": torch.ones(3)}, tmp_path / "small.pt")
    summary = ckptkit.summarize(range_server.url("small.pt"))
    assert summary.safety.verdict == "safe" and len(range_server.requests) == 1


def test_a_large_checkpoint_is_inspected_from_a_sliver_of_its_bytes(tmp_path, range_server):
    big = {f"w{i}": torch.zeros(1024, 1024) for i in range(8)}  # 32 MiB of tensors
    torch.save(big, tmp_path / "big.pt")
    save_file(big, tmp_path / "big.safetensors")
    for name in ("big.pt", "big.safetensors"):
        range_server.reset()
        summary = ckptkit.summarize(range_server.url(name))
        assert summary.nbytes == 32 * 2**20
        assert range_server.bytes_sent < 0.02 * (tmp_path / name).stat().st_size
        assert len(range_server.requests) <= 3


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
def test_convert_from_a_url_writes_what_a_local_convert_writes(files, range_server, run, name):
    result = run("convert", range_server.url(name), "remote.safetensors", "--strip-wrappers")
    assert result.exit_code == 0, result.stderr
    run("convert", files / name, "local.safetensors", "--strip-wrappers")
    assert (files / "remote.safetensors").read_bytes() == (files / "local.safetensors").read_bytes()
    out = load_file(files / "remote.safetensors")
    assert out.keys() == {k.removeprefix("module.") for k in STATE}
    for key, tensor in STATE.items():
        assert torch.equal(out[key.removeprefix("module.")], tensor)


def test_diff_and_load_read_a_url(files, range_server):
    url = range_server.url("m.pt")
    assert ckptkit.diff(url, files / "m.safetensors").equal
    state = ckptkit.load_state_dict(url, strip_wrappers=True)
    assert torch.equal(state["layers.3.v.weight"], STATE["module.layers.3.v.weight"])


def test_retries_ride_out_503s_and_dropped_connections(files, range_server, fast_retries):
    range_server.fail("503", times=2)
    range_server.fail("drop", times=1)
    report = ckptkit.convert(range_server.url("m.safetensors"), files / "out.safetensors")
    assert report.verified
    statuses = [r.status for r in range_server.requests]
    assert statuses[:2] == [503, 503] and range_server.requests[2].fault == "drop"
    assert load_file(files / "out.safetensors").keys() == STATE.keys()


def test_a_server_that_keeps_failing_ends_in_one_error_and_no_output(
    files, range_server, run, fast_retries
):
    range_server.fail("503", times=100)
    line = one_error(run("convert", range_server.url("m.pt"), "out.safetensors"), "m.pt")
    assert "tries" in line and "503" in line
    assert not (files / "out.safetensors").exists()
    assert len(range_server.requests) == remote_module.TRIES


def test_a_missing_url_and_unreadable_kinds_are_one_error_line(tmp_path, range_server, run):
    one_error(run("inspect", range_server.url("nope.pt")), "nope.pt does not exist")
    assert len(range_server.requests) == 1  # a 404 is an answer, not a failure to retry
    (tmp_path / "legacy.pt").write_bytes((FIXTURE_DIR / "legacy_dp.pt").read_bytes())
    one_error(run("inspect", range_server.url("legacy.pt")), "download it")
    (tmp_path / "empty.pt").write_bytes(b"")
    one_error(run("scan", range_server.url("empty.pt")), "empty")


def test_trust_and_writing_to_a_url_are_refused_plainly(files, range_server, run):
    one_error(run("convert", range_server.url("m.pt"), "o.pt", "--trust"), "--trust")
    one_error(run("convert", files / "m.pt", range_server.url("o.safetensors")), "URL")


def test_the_command_line_reads_a_url_in_a_subprocess(files, range_server):
    done = subprocess.run(
        [sys.executable, "-m", "ckptkit", "inspect", range_server.url("m.safetensors"), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["fetched"]["requests"] == 1


# ------------------------------------------------------------------------ RangeFile


def test_a_range_file_reads_like_a_local_file(files, range_server):
    local = (files / "m.pt").read_bytes()
    with RangeFile(open_remote(range_server.url("m.pt")), readahead=4096) as raw:
        assert raw.read(10) == local[:10]
        raw.seek(-100, 2)
        assert raw.read() == local[-100:]
        raw.seek(5000)
        buffer = bytearray(20_000)
        assert raw.readinto(buffer) == 20_000 and bytes(buffer) == local[5000:25_000]
        assert raw.pread(len(local) - 3, 10) == local[-3:]  # clipped at the end
        before = len(range_server.requests)
        assert raw.pread(2, 8) == local[2:10]  # cached: no request
        assert len(range_server.requests) == before


# ----------------------------------------------------------------------- memory:// and S3


def test_memory_urls_are_read_through_fsspec(files):
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/remote-test/m.pt", (files / "m.pt").read_bytes())
    try:
        summary = ckptkit.summarize("memory://remote-test/m.pt")
        assert summary.selected == "model" and summary.fetched["requests"] <= 3
        assert ckptkit.scan("memory://remote-test/m.pt").verdict == "safe"
    finally:
        fs.rm("/remote-test", recursive=True)


def test_s3_urls_inspect_and_convert_against_moto(files, s3_env, run):
    bucket = s3_env.bucket("ckpts")
    s3_env.fs.put(str(files / "m.pt"), f"{bucket}/run/m.pt")
    s3_env.fs.put(str(files / "m.safetensors"), f"{bucket}/run/m.safetensors")
    result = run("inspect", "s3://ckpts/run/m.safetensors", "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert len(doc["tensors"]) == len(STATE) and doc["fetched"]["requests"] <= 2  # size + 1
    result = run("convert", "s3://ckpts/run/m.pt", "out.safetensors", "--strip-wrappers")
    assert result.exit_code == 0, result.stderr
    out = load_file(files / "out.safetensors")
    assert all(torch.equal(out[k.removeprefix("module.")], v) for k, v in STATE.items())
    one_error(run("inspect", "s3://ckpts/run/missing.pt"), "does not exist")


def test_library_errors_are_ckptkit_errors(range_server):
    with pytest.raises(CkptkitError):
        ckptkit.summarize(range_server.url("nothing-here.safetensors"))
    with pytest.raises(UsageError):
        ckptkit.convert("memory://x/y.pt", range_server.url("out.safetensors"))  # read only


# ------------------------------------------------------------------- fetched ahead


class _Bytes(remote_module.Remote):
    """A Remote over bytes in memory that records each range asked for (a test double of the
    network only: everything above it is the real code)."""

    def __init__(self, data: bytes) -> None:
        super().__init__("mem://test")
        self.data, self.asked, self._size = data, [], len(data)

    def _stat(self) -> int:
        return len(self.data)

    def _range(self, start: int, end: int) -> bytes:
        self.asked.append((start, end))
        return self.data[start:end]


def test_the_prefetcher_joins_near_ranges_splits_large_ones_and_keeps_order():
    from ckptkit.storage.fetch import Prefetcher

    data = bytes(range(256)) * 4096  # 1 MiB
    remote = _Bytes(data)
    spans = [("a", remote, 0, 100), ("b", remote, 150, 50), ("c", remote, 1000, 300_000)]
    spans.append(("d", remote, 400_000, 10))
    fetcher = Prefetcher(spans, workers=2, chunk=128 * 1024)
    try:
        for key, _, offset, length in spans:
            assert b"".join(fetcher.pieces(key)) == data[offset : offset + length], key
    finally:
        fetcher.close()
    # a, b and the start of c share a request; the rest of c is cut at 128 KiB; d comes alone
    assert sorted(remote.asked)[0] == (0, 128 * 1024)
    assert all(e - s <= 128 * 1024 for s, e in remote.asked)
    assert len(remote.asked) == 4 and sorted(remote.asked)[-1] == (400_000, 400_010)


def test_the_prefetcher_gives_a_key_taken_out_of_order_and_bounds_what_it_holds():
    from ckptkit.storage.fetch import Prefetcher

    data = bytes(range(256)) * 4096
    remote = _Bytes(data)
    spans = [(str(i), remote, i * 65_536, 65_536) for i in range(16)]
    fetcher = Prefetcher(spans, workers=3, chunk=65_536)
    try:
        assert b"".join(fetcher.pieces("9")) == data[9 * 65_536 : 10 * 65_536]
        assert b"".join(fetcher.pieces("2")) == data[2 * 65_536 : 3 * 65_536]  # fetched alone
        held = [r for r in fetcher._requests if r.future is not None]
        assert len(held) <= 3 + 1
        for i in range(10, 16):
            assert b"".join(fetcher.pieces(str(i))) == data[i * 65_536 : (i + 1) * 65_536]
    finally:
        fetcher.close()


def test_a_zip_member_whose_bytes_miss_its_crc_is_refused_when_fetched(files, range_server, run):
    """The zip's directory records each member's CRC-32: bytes fetched from a URL are checked
    against it (a local copy is compared with the file itself instead)."""
    import zipfile

    raw = bytearray((files / "m.pt").read_bytes())
    with zipfile.ZipFile(files / "m.pt") as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("/data/0"))
        directory = zf.start_dir
    entry = raw.index(b"PK\x01\x02" + raw[directory + 4 : directory + 16], directory)
    while raw[entry + 46 : entry + 46 + len(info.filename)] != info.filename.encode():
        name, extra, comment = (
            int.from_bytes(raw[entry + o : entry + o + 2], "little") for o in (28, 30, 32)
        )
        entry += 46 + name + extra + comment
    raw[entry + 16] ^= 0xFF  # the recorded CRC-32, not the data
    (files / "bad.pt").write_bytes(raw)
    line = one_error(run("convert", range_server.url("bad.pt"), "out.safetensors"), "CRC-32")
    assert "bad.pt" in line and not (files / "out.safetensors").exists()


def test_a_zip_whose_storages_record_no_crc_converts_from_a_url(files, range_server):
    """ckptkit's own .pt writer (and torch under set_crc32_options(False)) records a CRC of 0
    for storages: no CRC to check against, so none is."""
    ckptkit.convert(files / "m.safetensors", files / "written.pt")
    report = ckptkit.convert(range_server.url("written.pt"), files / "back.safetensors")
    assert report.verified and ckptkit.diff(files / "back.safetensors", files / "m.pt").equal


def test_a_large_remote_convert_holds_a_few_requests_in_memory(tmp_path, range_server):
    """48 MiB fetched through 4 workers of 8 MiB requests: the peak stays far below the file."""
    torch.save({f"w{i}": torch.randn(1024, 1024) for i in range(12)}, tmp_path / "big.pt")
    _, grown_mb = grown_in_a_child(
        "ckptkit, torch, safetensors.torch",
        "ckptkit.convert(sys.argv[1], sys.argv[2], workers=4)",
        range_server.url("big.pt"),
        tmp_path / "o.safetensors",
    )
    assert grown_mb < 48, f"{grown_mb:.0f} MB over the imports"
    out = load_file(tmp_path / "o.safetensors")
    assert len(out) == 12


# ---------------------------------------------------------------- sharded, and outputs


def test_a_sharded_checkpoint_at_a_url_is_its_index_and_one_request_a_shard(files, range_server):
    (files / "sh").mkdir()
    ckptkit.convert(files / "m.pt", files / "sh" / "model.safetensors", max_shard_size="100kB")
    shards = len(list((files / "sh").glob("model-*.safetensors")))
    assert shards > 2
    range_server.reset()
    summary = ckptkit.summarize(range_server.url("sh/model.safetensors.index.json"))
    assert summary.format == "sharded safetensors" and len(summary.shards) == shards
    assert len(range_server.requests) == shards + 1  # the index, then each shard's header
    assert summary.fetched["requests"] == shards + 1  # every request counted, the index's too
    report = ckptkit.convert(
        range_server.url("sh/model.safetensors.index.json"), files / "one.safetensors"
    )
    assert report.verified and ckptkit.diff(files / "one.safetensors", files / "m.pt").equal


def _objects(s3, prefix):
    s3.fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in s3.fs.find(prefix))


def test_convert_to_s3_appears_whole_and_keeps_the_exists_rule(files, s3_env, run):
    s3_env.bucket("out")
    result = run("convert", files / "m.pt", "s3://out/run/model.safetensors", "--strip-wrappers")
    assert result.exit_code == 0, result.stderr
    assert "s3://out/run/model.safetensors" in result.stdout
    assert _objects(s3_env, "out/run") == ["model.safetensors"]
    s3_env.fs.get("out/run/model.safetensors", str(files / "back.safetensors"))
    back = load_file(files / "back.safetensors")
    assert all(torch.equal(back[k.removeprefix("module.")], v) for k, v in STATE.items())
    one_error(run("convert", files / "m.pt", "s3://out/run/model.safetensors"), "--force")
    result = run("convert", files / "m.pt", "s3://out/run/model.safetensors", "--force")
    assert result.exit_code == 0, result.stderr


def test_a_sharded_output_at_s3_and_a_remote_to_remote_convert(files, s3_env):
    s3_env.bucket("out")
    report = ckptkit.convert(
        files / "m.safetensors", "s3://out/sh/model.safetensors", max_shard_size="100kB"
    )
    names = _objects(s3_env, "out/sh")
    assert names[-1] == "model.safetensors.index.json" and len(names) == len(report.files)
    again = ckptkit.convert("s3://out/sh/model.safetensors.index.json", "s3://out/one/m.pt")
    assert again.verified and _objects(s3_env, "out/one") == ["m.pt"]
    s3_env.fs.get("out/one/m.pt", str(files / "one.pt"))
    assert ckptkit.diff(files / "one.pt", files / "m.safetensors").equal


def test_a_failed_upload_leaves_no_object_and_no_open_upload(files, s3_env, run, monkeypatch):
    """The first shard goes up as a multipart upload (parts of 5 MiB, S3's least) that is never
    completed: the cast overflow in the last shard aborts it, and nothing is listed."""
    import ckptkit.storage.upload as upload

    monkeypatch.setattr(upload, "PART", 5 * 2**20)
    s3_env.bucket("out")
    client = s3_env.client()
    open_uploads = []
    real_add = upload.Uploads.add

    def add(self, local, name):
        real_add(self, local, name)
        open_uploads.append(len(client.list_multipart_uploads(Bucket="out").get("Uploads", [])))

    monkeypatch.setattr(upload.Uploads, "add", add)
    g = torch.Generator().manual_seed(0)
    state = {f"a.{i}": torch.randn(1024, 1024, generator=g) for i in range(12)}  # 24 MB in fp16
    state["zz.big"] = torch.full((8,), 1e30)  # overflows fp16, in the last shard
    save_file(state, files / "over.safetensors")
    result = run(
        "convert", files / "over.safetensors", "s3://out/bad/model.safetensors",
        "--dtype", "fp16", "--max-shard-size", "12MB",
    )  # fmt: skip
    one_error(result, "inf")
    assert open_uploads and open_uploads[0] == 1  # a shard was up, not completed
    assert _objects(s3_env, "out/bad") == []
    assert client.list_multipart_uploads(Bucket="out").get("Uploads", []) == []


class _StagedPeak:
    """The most bytes the staging folder held on disk, sampled every few milliseconds while
    a conversion runs (a real measurement: blocks allocated, holes not counted)."""

    def __init__(self, folder: Path):
        import threading

        self.folder, self.peak, self._stop = folder, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample)

    def _sample(self):
        while not self._stop.wait(0.002):
            used = 0
            for path in self.folder.rglob("*"):
                try:
                    used += path.stat().st_blocks * 512 if path.is_file() else 0
                except FileNotFoundError:  # removed while listed
                    pass
            self.peak = max(self.peak, used)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@pytest.mark.slow  # 2 x 384 MiB through moto
@pytest.mark.parametrize("name", ["model.safetensors", "model.pt"])
def test_an_output_is_uploaded_while_it_is_written(files, s3_env, monkeypatch, name):
    """A 384 MiB output at S3 never lies whole on the local disk: each part goes up once
    written and checked, and its tensor bytes are freed (a hole punched; a .pt's records stay
    for its check); the object read back is what a local conversion writes."""
    stage = files / "stage"
    stage.mkdir()
    monkeypatch.setenv("CKPTKIT_STAGING", str(stage))
    s3_env.bucket("out")
    g = torch.Generator().manual_seed(0)
    state = {f"w.{i}": torch.randn(2 * 2**20, generator=g) for i in range(48)}  # 8 MiB each
    save_file(state, files / "big.safetensors")
    with _StagedPeak(stage) as staged:
        report = ckptkit.convert(files / "big.safetensors", f"s3://out/m/{name}")
    size = s3_env.fs.size(f"out/m/{name}")
    assert report.verified and size > 384 * 2**20
    assert 0 < staged.peak < size * 0.4, staged.peak  # ~130 MiB of 384 here; whole before
    back = files / f"back-{name}"
    s3_env.fs.get(f"out/m/{name}", str(back))
    ckptkit.convert(files / "big.safetensors", files / name)  # the same, on disk
    if name.endswith(".safetensors"):
        assert back.read_bytes() == (files / name).read_bytes()
    else:  # torch's zip holds a random serialization id: the same records, the same tensors
        assert back.stat().st_size == (files / name).stat().st_size
        loaded = torch.load(back, weights_only=True, mmap=True)
        assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_a_cast_uploaded_while_written_is_checked_by_what_was_written(files, s3_env):
    """Tensors made through torch (a cast) are checked by the CRC-32 of the bytes written,
    since their parts have left the disk when the writer's check comes (made again from
    the source, they would be compared with the zeros of a punched hole)."""
    s3_env.bucket("out")
    g = torch.Generator().manual_seed(1)
    state = {f"w.{i}": torch.randn(4 * 2**20, generator=g) for i in range(4)}  # 64 MiB f32
    save_file(state, files / "f32.safetensors")
    report = ckptkit.convert(files / "f32.safetensors", "s3://out/h.safetensors", dtype="bf16")
    assert report.verified and report.through_torch == 4
    s3_env.fs.get("out/h.safetensors", str(files / "h.safetensors"))
    back = load_file(files / "h.safetensors")
    assert all(torch.equal(back[k], v.to(torch.bfloat16)) for k, v in state.items())


def test_a_streamed_upload_that_fails_leaves_no_object_and_no_open_upload(files, s3_env, run):
    """Parts of a single file are up when the cast of its last tensor overflows: the
    multipart upload is aborted, nothing is listed, nothing stays staged."""
    s3_env.bucket("out")
    client = s3_env.client()
    g = torch.Generator().manual_seed(0)
    state = {f"a.{i}": torch.randn(2**20, 8, generator=g) for i in range(8)}  # 64 MB in fp16
    state["zz.big"] = torch.full((8,), 1e30)  # overflows fp16, written last
    save_file(state, files / "over.safetensors")
    result = run(
        "convert", files / "over.safetensors", "s3://out/one.safetensors", "--dtype", "fp16"
    )
    one_error(result, "inf")
    assert _objects(s3_env, "out") == []
    assert client.list_multipart_uploads(Bucket="out").get("Uploads", []) == []


def test_a_dcp_output_at_a_url_is_what_torch_reads(files, s3_env, run):
    """``--to dcp`` at an S3 URL: the chunks' file uploaded as written, ``.metadata`` last;
    torch's own reader (``dcp.load`` through ``FsspecReader``) gives the tensors back, ckptkit
    reads it from the URL, and the folder is refused when it holds anything, unless --force
    (which removes the DCP files this save did not write, and nothing else)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    s3_env.bucket("out")
    report = ckptkit.convert(files / "m.pt", "s3://out/save", to="dcp")
    assert report.verified and report.destination == "s3://out/save"
    assert _objects(s3_env, "out/save") == sorted([".metadata", "__0_0.distcp", "ckptkit.json"])
    back = {k: torch.empty_like(v) for k, v in STATE.items()}
    with single_process_dcp():
        dcp.load(back, storage_reader=FsspecReader("s3://out/save"), no_dist=True)
    assert all(torch.equal(back[k], v) for k, v in STATE.items())
    assert ckptkit.diff("s3://out/save", files / "m.pt").equal
    one_error(run("convert", files / "m.pt", "s3://out/save", "--to", "dcp"), "exists", "--force")
    s3_env.fs.pipe("out/save/__1_0.distcp", b"another save's rank file")
    s3_env.fs.pipe("out/save/important.txt", b"not ckptkit's: kept")
    again = run("convert", files / "m.pt", "s3://out/save", "--to", "dcp", "--force")
    assert again.exit_code == 0, again.stderr
    assert "__1_0.distcp" not in _objects(s3_env, "out/save")
    assert s3_env.fs.cat("out/save/important.txt") == b"not ckptkit's: kept"


def test_a_dcp_output_replaced_at_a_url_never_mixes_two_saves(files, s3_env, monkeypatch):
    """--force over a DCP save at a URL: the old .metadata (byte offsets into the old chunks)
    goes before the new files are committed, so a failure among the commits leaves no save
    to read, never the old .metadata over the new chunks (torch would load wrong values)."""
    import ckptkit.storage.upload as upload

    s3_env.bucket("out")
    ckptkit.convert(files / "m.pt", "s3://out/save", to="dcp")
    other = {k: v + 1 for k, v in STATE.items()}
    torch.save({"model": dict(reversed(list(other.items())))}, files / "other.pt")
    real_commit = upload.Uploads.commit

    def commit(self, **options):  # the last commit (.metadata) fails, as a network might
        def fail():
            raise OSError("connection reset")

        self._open[-1][0].commit = fail
        real_commit(self, **options)

    monkeypatch.setattr(upload.Uploads, "commit", commit)
    with pytest.raises(CkptkitError, match="connection reset"):
        ckptkit.convert(files / "other.pt", "s3://out/save", to="dcp", force=True)
    assert ".metadata" not in _objects(s3_env, "out/save")
    with pytest.raises(CkptkitError):
        ckptkit.summarize("s3://out/save")


def test_a_failed_conversion_to_memory_leaves_nothing(files, run):
    """fsspec's memory:// stores a file when it is opened (no deferred commit): there the
    output goes up whole once written, and a failure removes what went up."""
    import fsspec

    state = {f"a.{i}": torch.randn(2**16, 4) for i in range(4)}
    state["zz.big"] = torch.full((8,), 1e30)  # overflows fp16
    save_file(state, files / "over.safetensors")
    one_error(
        run("convert", files / "over.safetensors", "memory://o/x.safetensors", "--dtype", "fp16"),
        "inf",
    )
    assert not fsspec.filesystem("memory").exists("/o/x.safetensors")


def test_sparse_tensors_go_to_a_url_through_torch_save(files, s3_env):
    """A .pt output holding a sparse tensor is written by torch.save (not laid out by ckptkit)
    in the staging folder, then uploaded whole."""
    s3_env.bucket("out")
    state = {"dense": torch.randn(4, 4), "sparse": torch.randn(6, 6).relu().to_sparse()}
    torch.save(state, files / "sp.pt")
    report = ckptkit.convert(files / "sp.pt", "s3://out/sp.pt")
    assert report.verified
    back = torch.load(io.BytesIO(s3_env.fs.cat("out/sp.pt")), weights_only=True)
    assert torch.equal(back["sparse"].to_dense(), state["sparse"].to_dense())


def test_an_http_output_and_a_folder_url_are_refused(files, range_server, run):
    one_error(run("convert", files / "m.pt", range_server.url("o.safetensors")), "HTTP")
    one_error(run("convert", files / "m.pt", "memory://x/outdir"), "memory://x/outdir", ".pt")


def test_a_dcp_folder_at_a_url_is_read_from_its_metadata_and_chunks(tmp_path, range_server):
    shutil.copytree(FIXTURE_DIR / "dcp" / "fsdp2", tmp_path / "fsdp2")
    for url in (range_server.url("fsdp2"), range_server.url("fsdp2/.metadata")):
        summary = ckptkit.summarize(url)
        local = ckptkit.summarize(tmp_path / "fsdp2")
        assert (
            summary.format == "dcp" and summary.to_dict()["tensors"] == local.to_dict()["tensors"]
        )
        assert summary.file_size == local.file_size
    report = ckptkit.convert(range_server.url("fsdp2"), tmp_path / "o.safetensors")
    assert report.verified and report.copied == len(local.tensors)
    assert ckptkit.diff(tmp_path / "o.safetensors", tmp_path / "fsdp2").equal


def test_a_dcp_folder_at_a_url_is_inspected_from_its_metadata_alone(tmp_path, s3_env):
    """A DCP save's headers are its .metadata: inspect lists the folder (which gives every
    file's size), reads .metadata, then the save's plain values (step, extra), which dcp.save
    writes side by side, in one request. No tensor chunk's archive is read."""
    s3_env.bucket("ckpts")
    s3_env.fs.put(str(FIXTURE_DIR / "dcp" / "fsdp2") + "/", "ckpts/save/", recursive=True)
    summary = ckptkit.summarize("s3://ckpts/save/.metadata")
    local = ckptkit.summarize(FIXTURE_DIR / "dcp" / "fsdp2")
    assert summary.to_dict()["tensors"] == local.to_dict()["tensors"]
    assert summary.extras == local.extras and summary.extras["step"] == 3
    assert summary.file_size == local.file_size
    metadata = (FIXTURE_DIR / "dcp" / "fsdp2" / ".metadata").stat().st_size
    assert summary.fetched is not None and summary.fetched["requests"] == 3  # list, read, values
    values_file = (FIXTURE_DIR / "dcp" / "fsdp2" / "__1_0.distcp").stat().st_size
    assert summary.fetched["bytes"] < metadata + values_file  # not the values' file whole


def test_a_dcp_folder_whose_missing_side_files_answer_403_is_read(tmp_path, range_server):
    """A bucket that does not let one list answers 403 for a missing key: the probe of
    meta.pt and ckptkit.json finds them absent, as a 404 would."""
    shutil.copytree(FIXTURE_DIR / "dcp" / "fsdp2", tmp_path / "fsdp2")
    range_server.fail("403", match="meta.pt")
    range_server.fail("403", match="ckptkit.json")
    summary = ckptkit.summarize(range_server.url("fsdp2/.metadata"))
    assert summary.format == "dcp" and summary.extras["step"] == 3


def test_a_dcp_folder_over_http_reads_metadata_values_and_probes(tmp_path, range_server):
    """Over HTTP (no listing) the side files are probed once each and the data files' sizes
    asked; the chunk archives are never read (one request per data file, none twice)."""
    shutil.copytree(FIXTURE_DIR / "dcp" / "fsdp2", tmp_path / "fsdp2")
    summary = ckptkit.summarize(range_server.url("fsdp2/.metadata"))
    assert summary.extras["extra"] == {"lr": 0.01, "name": "ckptkit"}
    paths = [r.path for r in range_server.requests]
    assert sorted(paths) == sorted(
        f"/fsdp2/{name}"
        for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt", "ckptkit.json")
    )
    assert summary.fetched == {"requests": 5, "bytes": sum(r.sent for r in range_server.requests)}


def test_a_back_end_error_is_one_line_naming_it(files, s3_env, run, monkeypatch):
    s3_env.bucket("ckpts")
    s3_env.fs.put(str(files / "m.pt"), "ckpts/m.pt")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    servers.drop_cached_filesystems()  # a filesystem made with the keys would still have them
    line = one_error(run("inspect", "s3://ckpts/m.pt"), "s3://ckpts/m.pt", "Credentials")
    assert "internal error" not in line


# ------------------------------------------------------------- what review found


def test_a_redirect_is_followed_and_its_target_kept(files, range_server):
    range_server.redirects["/latest/model.safetensors"] = "/m.safetensors"
    url = range_server.url("latest/model.safetensors")
    report = ckptkit.convert(url, files / "out.safetensors")
    assert report.verified and ckptkit.diff(files / "out.safetensors", files / "m.pt").equal
    redirected = [r for r in range_server.requests if r.status == 302]
    assert len(redirected) == 1  # later reads go where it pointed


def test_a_server_that_ignores_ranges_is_read_from_its_start_only(files, range_server, run):
    range_server.ignore_ranges = True
    summary = ckptkit.summarize(range_server.url("m.safetensors"))  # the header: bytes 0..
    assert len(summary.tensors) == len(STATE)
    assert summary.fetched["bytes"] == 256 * 1024  # what was read of the 590 kB body
    line = one_error(run("convert", range_server.url("m.safetensors"), "o.safetensors"))
    assert "ignores range requests" in line and not (files / "o.safetensors").exists()


def test_connections_are_pooled_not_one_per_thread(files, range_server):
    from concurrent.futures import ThreadPoolExecutor

    remote = open_remote(range_server.url("m.pt"))
    try:
        for _ in range(5):  # five pools of 4 threads, as five prefetchers would be
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda i: remote.read(i * 1000, i * 1000 + 100), range(40)))
        assert len(remote._idle) <= 4
    finally:
        remote.close()


def test_a_range_file_keeps_no_block_larger_than_its_cache(files, range_server):
    local = (files / "m.pt").read_bytes()
    raw = RangeFile(open_remote(range_server.url("m.pt")), readahead=1024, cache_bytes=64 * 1024)
    with raw:
        raw.prefetch_tail(4096)
        assert raw.pread(0, len(local) - 100) == local[:-100]  # a large gap before the tail
        assert sum(len(b) for b in raw._blocks.values()) <= 64 * 1024


def test_a_folder_at_a_url_is_read_by_its_layout(files, s3_env, run):
    """A model repository or a DCP save named by its folder (a prefix): listed, then read as
    a local folder of that layout is."""
    s3_env.bucket("repo")
    ckptkit.convert(files / "m.pt", files / "sh" / "model.safetensors", max_shard_size="100kB")
    s3_env.fs.put(str(files / "sh") + "/", "repo/sharded/", recursive=True)
    s3_env.fs.put(str(files / "m.safetensors"), "repo/single/model.safetensors")
    s3_env.fs.pipe("repo/single/config.json", b"{}")
    s3_env.fs.put(str(FIXTURE_DIR / "dcp" / "fsdp2") + "/", "repo/dcp/", recursive=True)
    s3_env.fs.pipe("repo/notes/readme.txt", b"no weights here")
    assert ckptkit.summarize("s3://repo/sharded").format == "sharded safetensors"
    assert len(ckptkit.summarize("s3://repo/single/").tensors) == len(STATE)
    assert ckptkit.summarize("s3://repo/dcp").format == "dcp"
    report = ckptkit.convert("s3://repo/sharded", files / "whole.safetensors")
    assert report.verified and ckptkit.diff(files / "whole.safetensors", files / "m.pt").equal
    one_error(run("inspect", "s3://repo/notes"), "readme.txt", "give the checkpoint file")


def test_diff_of_a_url_fetches_ahead_in_bounded_memory(tmp_path, range_server):
    """A 64 MiB tensor at a URL diffed against a changed local copy: found different, with a
    few requests' bytes in memory, not the tensor (it was loaded whole before)."""
    big = torch.randn(16 * 2**20, generator=torch.Generator().manual_seed(1))
    torch.save({"big": big, "small": torch.ones(3)}, tmp_path / "a.pt")
    changed = big.clone()
    changed[12_345_678] += 1
    save_file({"big": changed, "small": torch.ones(3)}, tmp_path / "b.safetensors")
    printed, grown_mb = grown_in_a_child(
        "json, ckptkit, torch, numpy, ckptkit.diff",
        "r = ckptkit.diff(sys.argv[1], sys.argv[2])\n"
        "print(json.dumps([r.different[0].key, r.different[0].differing, r.common]))",
        range_server.url("a.pt"),
        tmp_path / "b.safetensors",
    )
    key, differing, common = json.loads(printed)
    assert (key, differing, common) == ("big", 1, 2)
    assert grown_mb < 56, f"{grown_mb:.0f} MB over the imports"


def test_stats_of_a_url_equal_the_local_files(files, range_server, run):
    local = ckptkit.tensor_stats(files / "m.pt", select="model")
    remote = ckptkit.tensor_stats(range_server.url("m.pt"), select="model")
    assert remote == local and len(remote) == len(STATE)
    result = run("inspect", range_server.url("m.safetensors"), "--stats", "--json")
    assert result.exit_code == 0, result.stderr


def test_a_folder_url_output_is_written_into_or_as_a_model_folder(files, s3_env, run):
    s3_env.bucket("out")
    result = run("convert", files / "m.pt", "s3://out/into/", "--max-shard-size", "100kB")
    assert result.exit_code == 0, result.stderr
    names = _objects(s3_env, "out/into")
    assert names[-1] == "model.safetensors.index.json" and len(names) > 3
    base = FIXTURE_DIR / "adapters" / "bert_base"  # a transformers model folder
    result = run("convert", base, "s3://out/bert")
    assert result.exit_code == 0, result.stderr
    names = _objects(s3_env, "out/bert")
    assert "model.safetensors" in names and "config.json" in names
    one_error(run("convert", base, "s3://out/bert"), "exists", "--force")
    back = files / "back"
    s3_env.fs.get("out/bert/", str(back) + "/", recursive=True)
    assert ckptkit.diff(back, base).equal


def test_a_model_folder_at_a_url_converts_to_a_model_folder(files, s3_env):
    """A transformers folder at a URL, converted to a model folder here and at a URL: its
    config and tokenizer files are copied beside the weights, as from a local folder, and
    transformers loads the result."""
    from transformers import AutoModel

    base = FIXTURE_DIR / "adapters" / "bert_base"
    s3_env.bucket("repo")
    s3_env.fs.put(str(base) + "/", "repo/bert/", recursive=True)
    report = ckptkit.convert("s3://repo/bert", files / "bert", dtype="bf16")
    assert report.verified and "config.json" in report.copied_files
    assert (files / "bert" / "config.json").read_bytes() == (base / "config.json").read_bytes()
    loaded, original = AutoModel.from_pretrained(files / "bert"), AutoModel.from_pretrained(base)
    for (name, value), (_, before) in zip(
        loaded.state_dict().items(), original.state_dict().items(), strict=True
    ):
        assert torch.equal(value, before.to(torch.bfloat16).to(value.dtype)), name
    again = ckptkit.convert("s3://repo/bert", "s3://repo/bert-bf16", dtype="bf16")
    assert again.verified and "config.json" in _objects(s3_env, "repo/bert-bf16")


def test_scan_of_a_folder_url_scans_each_checkpoint_in_it(files, s3_env, run):
    s3_env.bucket("mixed")
    s3_env.fs.put(str(FIXTURE_DIR / "malicious.pt"), "mixed/run/malicious.pt")
    s3_env.fs.put(str(files / "m.safetensors"), "mixed/run/model.safetensors")
    s3_env.fs.pipe("mixed/run/notes.txt", b"not a checkpoint")
    result = run("scan", "s3://mixed/run", "--json")
    assert result.exit_code == 1  # one is dangerous
    verdicts = {r["path"]: r["verdict"] for r in json.loads(result.stdout)["files"]}
    assert verdicts == {
        "s3://mixed/run/malicious.pt": "dangerous",
        "s3://mixed/run/model.safetensors": "safe",
    }


def test_a_killed_runs_incomplete_upload_is_aborted_by_the_next_run(files, s3_env):
    """What a run killed before its commit leaves (an open multipart upload to the output's
    key: invisible, but stored) is aborted when the output is written again."""
    s3_env.bucket("out")
    client = s3_env.client()
    client.create_multipart_upload(Bucket="out", Key="run/model.safetensors")  # the leftover
    client.create_multipart_upload(Bucket="out", Key="run/other.bin")  # not ours: stays
    ckptkit.convert(files / "m.safetensors", "s3://out/run/model.safetensors")
    left = [u["Key"] for u in client.list_multipart_uploads(Bucket="out").get("Uploads", [])]
    assert left == ["run/other.bin"]
    assert _objects(s3_env, "out/run") == ["model.safetensors"]


def test_parts_written_to_s3_are_finished_there(files, s3_env, run):
    s3_env.bucket("out")
    dst = "s3://out/parts/model.safetensors"
    for part in ("1/2", "2/2"):
        result = run("convert", files / "m.pt", dst, "--max-shard-size", "100kB", "--part", part)
        assert result.exit_code == 0, result.stderr
    assert "model.safetensors.index.json" not in _objects(s3_env, "out/parts")
    result = run("convert", "--finish", dst)
    assert result.exit_code == 0, result.stderr
    ckptkit.convert(files / "m.pt", files / "one" / "model.safetensors", max_shard_size="100kB")
    s3_env.fs.get("out/parts/", str(files / "back") + "/", recursive=True)
    local = {p.name: p.read_bytes() for p in (files / "one").iterdir()}
    assert {p.name: p.read_bytes() for p in (files / "back").iterdir()} == local
    one_error(run("convert", "--finish", dst), "exists", "--force")


def test_force_over_a_sharded_output_at_a_url_removes_its_stale_shards(files, s3_env):
    s3_env.bucket("out")
    dst = "s3://out/sh/model.safetensors"
    ckptkit.convert(files / "m.safetensors", dst, max_shard_size="100kB")
    many = _objects(s3_env, "out/sh")
    report = ckptkit.convert(files / "m.safetensors", dst, max_shard_size="400kB", force=True)
    fewer = _objects(s3_env, "out/sh")
    assert len(fewer) < len(many) and sorted(Path(f).name for f in report.files) == fewer


def test_a_run_folder_at_a_url_is_read_through_its_latest(s3_env, tmp_path, monkeypatch):
    from ckptkit.engine import train

    monkeypatch.chdir(tmp_path)
    s3_env.bucket("runs")
    train(mode="single", epochs=2, out="s3://runs/r")
    summary = ckptkit.summarize("s3://runs/r")
    assert summary.selected == "model" and summary.training.get("epoch") == 2


def test_a_folder_url_over_http_says_it_cannot_be_listed(tmp_path, range_server, run):
    (tmp_path / "folder").mkdir()
    one_error(run("inspect", range_server.url("folder")), "cannot be listed over HTTP")
