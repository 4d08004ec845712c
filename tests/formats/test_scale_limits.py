"""Every reader at scale: a sharded folder opens in time linear in its keys, the pickle budget
grows with the pickle (bombs still stop early), 100,000-tensor files are read, inspected and
converted in bounded memory, and a deflated zip member is streamed through its decompressor and
checked against its CRC-32. Timings live in bench/scale.py, never in assertions here."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from helpers import ROOT, run_measured
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import ckptkit
from ckptkit.errors import FormatError, VerificationError
from ckptkit.formats.base.dtypes import DTYPES, TensorSpec
from ckptkit.formats.base.tensors import bit_equal
from ckptkit.formats.files.safetensors import SafetensorsSource, header_bytes, read_header
from ckptkit.formats.files.torchfile import TorchFileSource
from ckptkit.formats.files.torchzip import ZipIndex, begin_archive, state_pickle, tensor_record
from ckptkit.formats.folders.sharded import ShardedSource
from ckptkit.formats.open import open_source
from ckptkit.formats.output import copier as copier_module
from ckptkit.formats.pickles.machine import run_pickle
from ckptkit.formats.pickles.writer import dumps
from ckptkit.keys import build_plan
from ckptkit.summary import Summary, collapse

# -- sharded folders -----------------------------------------------------------------------


def _sharded(folder: Path, shards: int, keys: int) -> dict[str, str]:
    """A sharded folder of tiny safetensors shards; its weight map."""
    folder.mkdir(exist_ok=True)
    weight_map: dict[str, str] = {}
    per = -(-keys // shards)
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        state = {f"layers.{i}.w": torch.full((1,), float(i)) for i in range(s * per, (s + 1) * per)}
        save_file({k: v for k, v in state.items() if int(k.split(".")[1]) < keys}, folder / name)
        weight_map.update({k: name for k in state if int(k.split(".")[1]) < keys})
    index = {"metadata": {"total_size": 4 * keys}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return weight_map


def test_a_sharded_folder_asks_each_shard_for_its_keys_once(tmp_path, monkeypatch):
    """The index is checked against each shard's keys read once (a list rebuilt for every
    lookup made opening 160 shards of 100,000 keys take minutes)."""
    weight_map = _sharded(tmp_path / "m", 40, 4000)
    calls: list[Path] = []
    real = SafetensorsSource.keys

    def counting(self):
        calls.append(self.path)
        return real(self)

    monkeypatch.setattr(SafetensorsSource, "keys", counting)
    summary = ckptkit.summarize(tmp_path / "m")
    assert len(calls) == 40 and len(set(calls)) == 40
    assert sorted(k for k, _ in summary.tensors) == sorted(weight_map)
    assert summary.format == "sharded safetensors" and len(summary.shards) == 40
    with ShardedSource(
        tmp_path / "m" / "model.safetensors.index.json", opener=open_source
    ) as source:
        assert source.load("layers.3999.w").item() == 3999.0
        path, offset, length = source.byte_span("layers.17.w")
        with open(path, "rb") as f:
            f.seek(offset)
            assert struct.unpack("<f", f.read(length)) == (17.0,)


def test_an_index_naming_the_wrong_shard_is_refused(tmp_path):
    weight_map = _sharded(tmp_path / "m", 8, 80)
    index = tmp_path / "m" / "model.safetensors.index.json"
    weight_map["layers.5.w"] = "model-00008-of-00008.safetensors"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(FormatError, match="puts 'layers.5.w' in model-00008-of-00008"):
        ckptkit.summarize(tmp_path / "m")


# -- the pickle budget ---------------------------------------------------------------------


def _torch_like(n: int) -> bytes:
    """A pickle shaped like torch's of a state dict (every object memoized), without torch."""
    obj = {
        f"model.layers.{i}.weight": (("storage", "cpu", str(i), 64), 0, (8, 8), (8, 1), False)
        for i in range(n)
    }
    return pickle.dumps(obj, protocol=2)


def test_the_budget_grows_with_the_pickle():
    data = _torch_like(20_000)
    small = 1 << 20  # a base far below what the 20,000 entries cost
    assert run_pickle(data, budget=small).damaged is None
    fixed = run_pickle(data, budget=small, per_byte=0)  # what a fixed budget did
    assert fixed.damaged is not None and "outgrow its size" in fixed.damaged
    assert run_pickle(data).root == pickle.loads(data)


@pytest.mark.parametrize("one", [b"]", b"}", b"\x8f"])  # empty lists, dicts, sets
def test_a_bomb_stops_within_its_first_bytes(one):
    bomb = b"\x80\x02(" + one * 10_000_000 + b"l."
    run = run_pickle(bomb)
    assert run.damaged is not None and "a pickle bomb?" in run.damaged
    assert run.end < 2_000_000  # of 10 MB: stopped early, not at the end


def test_bytes_after_a_pickle_give_it_no_budget():
    """A pickle followed by other data (a legacy file's storages) is budgeted by the bytes it
    reads, never by the size of what it sits in."""
    cycle = b"\x80\x02]q\x00" + b"h\x00a" * 1_000_000 + b"."  # a list appended to itself
    tail = b"\0" * 50_000_000
    assert run_pickle(cycle + tail).damaged is None  # harmless: 8 MB of references
    tight = run_pickle(cycle + tail, budget=1 << 20, per_byte=2)  # costs 5.3 bytes a byte
    assert tight.damaged is not None and tight.end < len(cycle)
    memo = b"\x80\x02K\x01r\xff\xff\xff\xff0]."  # a memo index of 4G: one entry
    assert run_pickle(memo + tail).root == []


def test_memo_entries_not_kept_are_read_again_when_needed():
    """Entries no LONG_BINGET ahead names are counted, not kept; one read from further away
    than the look-ahead runs the pickle again keeping all, with the same result."""
    shared = ["shared", 1]
    far = [list(range(300)), shared, "x" * 9_000_000, shared, {"a": shared}]
    for protocol in (2, 4):
        data = pickle.dumps(far, protocol=protocol)
        assert run_pickle(data).root == pickle.loads(data)
    many = [[i, str(i)] for i in range(5000)]
    data = pickle.dumps([many, many[::-1], many[4000]], protocol=2)
    assert run_pickle(data).root == pickle.loads(data)


@pytest.mark.slow
def test_a_state_dict_of_100000_tensors_opens(tmp_path):
    """torch.save of 100,000 small tensors (12 MB of pickle), refused before as a bomb."""
    code = (
        "import sys, torch\n"
        "g = torch.Generator().manual_seed(0)\n"
        "torch.save({f'model.layers.{i // 100}.experts.{i % 100}.w': torch.randn(2, generator=g)"
        " for i in range(100_000)}, sys.argv[1])\n"
    )
    path = tmp_path / "many.pt"
    subprocess.run([sys.executable, "-c", code, str(path)], check=True)
    with TorchFileSource(path) as source:
        entries = source.entries()
        assert len(entries) == 100_000 and source.load(entries[-1][0]).shape == (2,)
    assert len(ckptkit.summarize(path).tensors) == 100_000


# -- large files in bounded memory ---------------------------------------------------------

COUNT = 50_000  # tensors; peaks grow linearly (bench/scale.py measures 100,000)


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    folder = tmp_path_factory.mktemp("many")
    code = (
        "import sys, torch\n"
        "from safetensors.torch import save_file\n"
        "g = torch.Generator().manual_seed(0)\n"
        "s = {f'model.layers.{i // 1000}.mlp.experts.{i % 1000}.weight': "
        "torch.randn(8, 8, generator=g) for i in range(int(sys.argv[1]))}\n"
        "torch.save(s, sys.argv[2]); save_file(s, sys.argv[3])\n"
    )
    pt, st_ = folder / "many.pt", folder / "many.safetensors"
    subprocess.run([sys.executable, "-c", code, str(COUNT), str(pt), str(st_)], check=True)
    return pt, st_


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "limit_mb"),
    [
        (("inspect", "pt"), 160),
        (("scan", "pt"), 160),
        (("inspect", "st"), 160),
        (("scan", "st"), 160),
        (("convert", "pt", "out.safetensors"), 200),
        (("convert", "pt", "out.pt"), 224),
        (("convert", "st", "out.safetensors"), 200),
        (("convert", "st", "out.pt"), 224),
    ],
    ids=lambda value: "-".join(value) if isinstance(value, tuple) else None,
)
def test_many_tensors_in_bounded_memory(many, tmp_path, args, limit_mb):
    """50,000 tensors peak at 70 to 135 MB here; a structure kept per tensor that was not
    needed (a future per copied tensor took 1.3 kB, a ZipInfo 400 bytes) shows as tens of MB."""
    files = {"pt": many[0], "st": many[1]}
    argv = [files.get(a, a) for a in args]
    code, out, said, peak_mb = run_measured(argv, tmp_path, 300)
    assert code == 0, said
    assert peak_mb < limit_mb, f"{' '.join(args)} peaked at {peak_mb:.0f} MB"
    if args[0] == "inspect":
        assert f"tensors     {COUNT}," in out
    if args[0] == "convert" and args[2].endswith(".safetensors"):
        assert len(load_file(tmp_path / args[2])) == COUNT


# -- deflated members ------------------------------------------------------------------------


def _rezip(src: Path, dst: Path, method: int = zipfile.ZIP_DEFLATED) -> None:
    """A torch zip's members written again compressed, as zip tools re-pack a checkpoint."""
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(dst, "w", method) as b:
        for info in a.infolist():
            b.writestr(info.filename, a.read(info.filename))


def _member_data(path: Path, suffix: str) -> tuple[int, int, int]:
    """(where a member's compressed bytes start, how many, where its central entry is)."""
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith(suffix))
        central = zf.start_dir
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    while raw[central + 46 : central + 46 + len(info.filename)] != info.filename.encode():
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", raw, central + 28)
        central += 46 + name_len + extra_len + comment_len
    return start, info.compress_size, central


STATE = {
    "big": torch.randn(50_000, generator=torch.Generator().manual_seed(0)),
    "ids": torch.arange(7, dtype=torch.int64),
    "view": torch.arange(100.0)[10:30],  # a view into a larger storage
    "half": torch.randn(3, 5).half(),
}


@pytest.fixture
def deflated(tmp_path):
    plain, packed = tmp_path / "plain.pt", tmp_path / "deflated.pt"
    torch.save(STATE, plain)
    _rezip(plain, packed)
    return packed


@pytest.mark.parametrize("method", [zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA])
def test_compressed_members_are_read_and_converted(tmp_path, method):
    plain, packed = tmp_path / "plain.pt", tmp_path / "packed.pt"
    torch.save(STATE, plain)
    _rezip(plain, packed, method)
    with TorchFileSource(packed) as source:
        assert source.byte_span("big") is None  # not in the file as it is: decompressed
        for key, tensor in STATE.items():
            assert bit_equal(source.load(key), tensor), key
    report = ckptkit.convert(packed, tmp_path / "o.safetensors", dtype="bf16")
    assert report.verified and report.through_torch == len(STATE)
    out = load_file(tmp_path / "o.safetensors")
    for key, tensor in STATE.items():
        want = tensor.bfloat16() if tensor.is_floating_point() else tensor
        assert bit_equal(out[key], want.contiguous()), key
    ckptkit.convert(packed, tmp_path / "o.pt")
    back = torch.load(tmp_path / "o.pt", weights_only=True)
    assert all(bit_equal(back[k], v.contiguous()) for k, v in STATE.items())


def test_a_deflated_storage_comes_in_pieces(deflated):
    with TorchFileSource(deflated) as source:
        pieces = list(source.stream("big", 4096))
        assert all(len(p) == 4096 for p in pieces[:-1]) and 0 < len(pieces[-1]) <= 4096
        assert b"".join(pieces) == STATE["big"].numpy().tobytes()
        view = b"".join(source.stream("view", 7))  # bytes 40..120 of a 400-byte storage
        assert view == STATE["view"].numpy().tobytes()
        assert source.stream("ids", 4096) is not None
    with TorchFileSource(deflated.with_name("plain.pt")) as plain:
        assert plain.stream("big", 4096) is None  # stored: copied, or mapped, as it lies


def test_diff_reads_a_deflated_storage_in_pieces(deflated, tmp_path):
    changed = dict(STATE, big=STATE["big"].clone())
    changed["big"][12_345] += 1.0
    other = tmp_path / "changed.pt"
    torch.save(changed, other)
    report = ckptkit.diff(deflated, other)
    assert [d.key for d in report.different] == ["big"]
    assert report.different[0].differing == 1
    assert ckptkit.diff(deflated, deflated.with_name("plain.pt")).equal


@pytest.mark.parametrize("damage", ["crc", "data"])
@pytest.mark.parametrize("command", ["convert", "diff"])
def test_a_damaged_deflated_member_is_one_error(deflated, run, tmp_path, damage, command):
    raw = bytearray(deflated.read_bytes())
    start, size, central = _member_data(deflated, "data/0")
    if damage == "crc":
        raw[central + 16] ^= 0xFF  # the CRC-32 the directory records
    else:
        raw[start + size // 2] ^= 0x40  # a bit of the deflated data
    bad = tmp_path / "bad.pt"
    bad.write_bytes(raw)
    args = ("convert", bad, "o.safetensors") if command == "convert" else ("diff", bad, deflated)
    result = run(*args)
    lines = result.stderr.splitlines()
    assert result.exit_code in (1, 2) and len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ") and "bad.pt" in lines[0], lines
    assert "zip member" in lines[0] and "Traceback" not in result.output
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.slow
def test_a_deflated_storage_is_never_whole_in_memory(tmp_path):
    """A 256 MiB storage, deflated, converts with a few pieces in memory: the peak stays
    far below the storage (reading it whole took twice its size and more)."""
    code = (
        "import shutil, sys, zipfile, torch\n"
        "g = torch.Generator().manual_seed(0)\n"
        "torch.save({'big': torch.randn(64 * 2**20, generator=g)}, sys.argv[1] + '.plain')\n"
        "with zipfile.ZipFile(sys.argv[1] + '.plain') as a, zipfile.ZipFile(sys.argv[1], 'w',"
        " zipfile.ZIP_DEFLATED, compresslevel=1) as b:\n"
        "    for info in a.infolist():\n"
        "        with a.open(info) as x, b.open(info.filename, 'w', force_zip64=True) as y:\n"
        "            shutil.copyfileobj(x, y, 1 << 20)\n"
    )
    src = tmp_path / "big.pt"
    subprocess.run([sys.executable, "-c", code, str(src)], check=True)
    (tmp_path / "big.pt.plain").unlink()
    baseline = subprocess.run(
        [sys.executable, "-c", "import re, torch, ckptkit.cli; print(re.search("
         "r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1])"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    base_mb = int(baseline.stdout) / 1024
    code_, _, said, peak_mb = run_measured(["convert", src, "out.safetensors"], tmp_path, 300)
    assert code_ == 0, said
    assert peak_mb - base_mb < 96, f"{peak_mb:.0f} MB at the peak, {base_mb:.0f} MB importing"
    with open(tmp_path / "out.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        assert json.loads(f.read(n))["big"]["shape"] == [64 * 2**20]
    # diff decompresses it a piece at a time too, against the copy it was converted to
    code_, said, _, peak_mb = run_measured(["diff", src, "out.safetensors"], tmp_path, 300)
    assert code_ == 0, said
    assert peak_mb - base_mb < 96, f"diff: {peak_mb:.0f} MB at the peak, {base_mb:.0f} importing"


# -- exact results, made differently -------------------------------------------------------


def _zip(kind: str) -> bytes:
    """An archive zipfile reads: torch's, ckptkit's zip64 one, one with a comment, one after
    other bytes, one with a name twice."""
    buf = io.BytesIO()
    torch.save({"a": torch.ones(3), "b": torch.zeros(2, 2)}, buf)
    if kind == "torch":
        return buf.getvalue()
    if kind == "prefixed":
        return b"junk" * 100 + buf.getvalue()
    out = io.BytesIO()
    if kind == "zip64":
        with tempfile.TemporaryFile() as f:
            specs = [TensorSpec("a", "float32", (3,))]
            archive = begin_archive(f.fileno(), state_pickle(specs)[0], zip64=True)
            archive.add("data/0", bytes(12))
            archive.finish()
            f.seek(0)
            return f.read()
    with zipfile.ZipFile(out, "w") as zf:
        zf.writestr("x/data.pkl", b"\x80\x02N.")
        zf.writestr("x/data/0", b"1234")
        if kind == "comment":
            zf.comment = b"a comment" * 50
        else:
            zf.writestr("x/data/0", b"second")  # a name twice, as some tools write
    return out.getvalue()


@pytest.mark.filterwarnings("ignore:Duplicate name:UserWarning")
@pytest.mark.parametrize("kind", ["torch", "prefixed", "zip64", "comment", "twice"])
def test_zip_index_reads_what_zipfile_reads(kind):
    data = _zip(kind)
    index = ZipIndex(io.BytesIO(data))
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        for info in zf.infolist():
            member = index.find(info.filename)
            got = (index.header[member], index.length[member], index.crc[member])
            want = zf.getinfo(info.filename)
            assert got == (want.header_offset, want.file_size, want.CRC), info.filename
            start = index.data_offset(member)
            assert data[start : start + want.file_size] == zf.read(info.filename)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.text(min_size=1, max_size=8),
            st.sampled_from(sorted(d for d in DTYPES if DTYPES[d].safetensors)),
            st.lists(st.integers(0, 5), max_size=3),
        ),
        max_size=6,
        unique_by=lambda t: t[0],
    ),
    st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
)
def test_headers_and_pickles_are_written_as_before(entries, metadata):
    """The safetensors header written entry by entry is json.dumps of the header dict; the
    state dict's pickle written tensor by tensor is dumps of the whole OrderedDict."""
    specs = [TensorSpec(k, d, tuple(s)) for k, d, s in entries]
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for spec in specs:
        code = DTYPES[spec.dtype].safetensors
        header[spec.key] = {
            "dtype": code,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    assert header_bytes(specs, metadata) == struct.pack("<Q", len(text)) + text
    pickled, storages = state_pickle(specs)
    state = OrderedDict((s.key, tensor_record(storages[s.key], s.dtype, s.shape)) for s in specs)
    assert pickled == dumps(state)


def test_a_header_read_back_is_the_json(tmp_path):
    state = {"a": torch.ones(2, 3), "b": torch.zeros(0), "c": torch.tensor(5, dtype=torch.int8)}
    save_file(state, tmp_path / "x.safetensors", metadata={"k": "v"})
    header, start = read_header(tmp_path / "x.safetensors")
    with open(tmp_path / "x.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        want = json.loads(f.read(n))
    assert start == 8 + n
    assert {k: dict(v) if k != "__metadata__" else v for k, v in header.items()} == want


def _collapse_reference(rows):
    """collapse as it was written first (every key split into parts)."""
    groups: dict = {}
    for position, (key, value) in enumerate(rows):
        parts = tuple(key.split("."))
        pattern = tuple("#" if p.isascii() and p.isdigit() else p for p in parts)
        groups.setdefault((pattern, value), []).append((position, parts))
    out = []
    for (pattern, value), members in groups.items():
        slots = [i for i, p in enumerate(pattern) if p == "#"]
        spans = {i: sorted({int(parts[i]) for _, parts in members}) for i in slots}
        combos = 1
        for i in slots:
            combos *= len(spans[i])
        if len(members) >= 3 and combos == len(members):
            from ckptkit.keyfold import _span

            path = tuple(_span(spans[i]) if i in spans else p for i, p in enumerate(pattern))
            out.append((members[0][0], path, value, len(members)))
        else:
            out.extend((position, parts, value, 1) for position, parts in members)
    return [(path, value, count) for _, path, value, count in sorted(out, key=lambda r: r[0])]


_PART = st.sampled_from(["layers", "0", "1", "2", "10", "q", "weight", "bias", "mlp", "x"])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(_PART, min_size=1, max_size=4).map(".".join), st.sampled_from("ab")),
        max_size=30,
        unique_by=lambda r: r[0],
    )
)
def test_collapse_folds_as_it_did(rows):
    assert collapse(rows) == _collapse_reference(rows)


_KEY_PART = st.sampled_from(
    ["module", "_orig_mod", "model", "n_averaged", "layers", "0", "1", "w", "base_model"]
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(_KEY_PART, min_size=1, max_size=4).map(".".join), unique=True))
def test_common_prefix_is_the_plans(keys):
    """The prefix inspect names is the one the full --strip-wrappers plan leaves."""
    summary = Summary(path="x", format="x", file_size=0, tensors=[(k, None) for k in keys])
    try:
        mapped = list(build_plan(keys, strip_wrappers=True).mapping.values())
    except ckptkit.CkptkitError:
        return
    heads = {k.split(".", 1)[0] for k in mapped if k}
    ok = len(mapped) >= 2 and len(heads) == 1 and all(k and "." in k for k in mapped)
    assert summary.common_prefix == (heads.pop() + "." if ok else None)


def test_a_copy_corrupted_past_the_first_batch_is_found(tmp_path, monkeypatch):
    """Copied bytes are compared in batches by a worker: a range in a later batch that
    differs from its source still fails the conversion, naming its key."""
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(1500)}
    save_file(state, tmp_path / "src.safetensors")
    real, seen = copier_module.copy_range, []

    def corrupting(src_fd, offset, count, dst_fd):
        real(src_fd, offset, count, dst_fd)
        seen.append(count)
        if len(seen) == 1200:
            os.pwrite(dst_fd, b"\x7f", os.lseek(dst_fd, 0, os.SEEK_CUR) - 1)

    monkeypatch.setattr(copier_module, "copy_range", corrupting)
    with SafetensorsSource(tmp_path / "src.safetensors") as source:
        key = source.keys()[1199]  # written in file order (save_file sorts the keys)
    with pytest.raises(VerificationError, match=f"'{key}' read back .* differs"):
        ckptkit.convert(tmp_path / "src.safetensors", tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()
