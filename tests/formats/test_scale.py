"""Copy-speed conversion, dtype casting and sharding: the fast path writes the very bytes the
torch path writes, torch stays unimported on it, and sharded output round-trips."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
import torch
from helpers import FIXTURE_DIR, FIXTURES, NOT_IN_LEGACY, ROOT, TORCH_DTYPES, load_with_ties
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file

import ckptkit
from ckptkit.convert import parse_size
from ckptkit.errors import CastError, UsageError, VerificationError
from ckptkit.formats.base.source import Source
from ckptkit.formats.base.tensors import bit_equal
from ckptkit.formats.output import copier as transfer_module

GOOD = [f for f in FIXTURES if not f.bad]


def convert_both_ways(monkeypatch, src, tmp, **options):
    """Convert twice: the default (byte copies where possible) and with torch for every tensor."""
    fast = ckptkit.convert(src, tmp / "fast.safetensors", **options)
    with monkeypatch.context() as m:
        for cls in _source_classes():
            m.setattr(cls, "byte_span", Source.byte_span)  # "no byte range": all through torch
        m.setattr(transfer_module, "PIECE", 24)  # many pieces per tensor, the last one short
        slow = ckptkit.convert(src, tmp / "slow.safetensors", **options)
    assert slow.copied == 0 and slow.through_torch == slow.tensors
    return fast, (tmp / "fast.safetensors").read_bytes(), (tmp / "slow.safetensors").read_bytes()


def _source_classes():
    from ckptkit.formats.files.safetensors import SafetensorsSource
    from ckptkit.formats.files.torchfile import TorchFileSource
    from ckptkit.formats.folders.sharded import ShardedSource

    return (TorchFileSource, SafetensorsSource, ShardedSource)


@pytest.mark.parametrize("fx", GOOD, ids=lambda f: f.name)
def test_fast_and_torch_paths_write_identical_files(fx, tmp_path, monkeypatch):
    fast, a, b = convert_both_ways(
        monkeypatch, FIXTURE_DIR / fx.name, tmp_path, strip_wrappers=True, allow_globals=fx.allow
    )
    assert a == b
    if fx.name != "transposed.pt":
        assert fast.copied == fast.tensors and fast.through_torch == 0


@st.composite
def state_dicts(draw):
    base = torch.arange(64, dtype=torch.uint8).view(torch.float32)  # 16 floats, one storage
    state = {"shared.a": base[:6], "shared.b": base[6:16].view(2, 5)}  # slices of one buffer
    for i in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(TORCH_DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))  # zero-size and 0-dim too
        numel = 1
        for n in shape:
            numel *= n
        raw = torch.randint(
            0, 256, (numel * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8
        )
        state[f"t{i}"] = raw.view(dtype).reshape(shape)
    if draw(st.booleans()):
        state["tied"] = state["shared.b"]
    return state


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(state=state_dicts(), legacy=st.booleans())
def test_generated_state_dicts_fast_equals_torch(tmp_path_factory, monkeypatch, state, legacy):
    tmp = tmp_path_factory.mktemp("gen")
    if legacy and any(t.dtype in NOT_IN_LEGACY for t in state.values()):
        legacy = False  # torch's legacy format cannot hold these dtypes
    torch.save(state, tmp / "src.pt", _use_new_zipfile_serialization=not legacy)
    _, a, b = convert_both_ways(monkeypatch, tmp / "src.pt", tmp)
    assert a == b
    back = load_with_ties(tmp / "fast.safetensors")
    for key, tensor in state.items():
        assert bit_equal(back[key], tensor.contiguous()), key


def test_fast_path_never_imports_torch(tmp_path):
    code = (
        "import sys, ckptkit\n"
        f"r = ckptkit.convert({str(FIXTURE_DIR / 'training.pt')!r}, {str(tmp_path / 'a.safetensors')!r}, strip_module=True)\n"
        f"ckptkit.convert({str(FIXTURE_DIR / 'legacy_dp.pt')!r}, {str(tmp_path / 'b.safetensors')!r}, strip_module=True)\n"
        f"ckptkit.convert({str(tmp_path / 'a.safetensors')!r}, {str(tmp_path / 'c.safetensors')!r}, add_module=True)\n"
        "assert r.verified and r.copied == 9, r\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("piece", [None, 24])
def test_cast_floats_only_and_report_savings(tmp_path, monkeypatch, piece):
    if piece:
        monkeypatch.setattr(transfer_module, "PIECE", piece)
    src = tmp_path / "mixed.pt"
    state = {
        "w": torch.randn(4, 4),
        "h": torch.randn(3).half(),
        "steps": torch.tensor(7),
        "mask": torch.tensor([True, False]),
        "ids": torch.arange(5, dtype=torch.int32),
    }
    torch.save(state, src)
    report = ckptkit.convert(src, tmp_path / "bf16.safetensors", dtype="bf16", keep_dtype=["h"])
    out = load_file(tmp_path / "bf16.safetensors")
    assert out["w"].dtype == torch.bfloat16 and torch.equal(out["w"], state["w"].bfloat16())
    assert out["h"].dtype == torch.float16  # kept by the glob
    assert (out["steps"].dtype, out["mask"].dtype, out["ids"].dtype) == (
        torch.int64,
        torch.bool,
        torch.int32,
    )
    assert report.cast == ["w"] and report.source_nbytes - report.nbytes == 32
    pt = ckptkit.convert(src, tmp_path / "fp32.pt", dtype="fp32")
    assert sorted(pt.cast) == ["h"]
    assert torch.load(tmp_path / "fp32.pt", weights_only=True)["h"].dtype == torch.float32


def test_overflow_is_an_error_naming_the_tensors(tmp_path, run):
    src = tmp_path / "big.pt"
    torch.save({"big": torch.tensor([1e6, 1.0]), "small": torch.ones(2)}, src)
    with pytest.raises(CastError, match="finite values into inf in big; nothing was written"):
        ckptkit.convert(src, tmp_path / "h.safetensors", dtype="fp16")
    assert not (tmp_path / "h.safetensors").exists()
    result = run("convert", "big.pt", "h.safetensors", "--dtype", "fp16")
    assert result.exit_code == 1
    assert result.stderr == (
        "Error: the cast turns finite values into inf in big; nothing was written; "
        "keep them with --keep-dtype GLOB, or pass --allow-overflow\n"
    )
    ok = ckptkit.convert(src, tmp_path / "h.safetensors", dtype="fp16", allow_overflow=True)
    assert ok.overflowed == ["big"] and torch.isinf(load_file(tmp_path / "h.safetensors")["big"][0])
    assert ckptkit.convert(
        src, tmp_path / "k.safetensors", dtype="fp16", keep_dtype=["big"]
    ).cast == ["small"]


def test_cast_in_pieces_matches_torch_and_finds_a_late_overflow(tmp_path, monkeypatch):
    """Tensors cast a few elements at a time: strided ones too, and an overflow in the very
    last piece is still found."""
    monkeypatch.setattr(transfer_module, "PIECE", 10)  # 5 fp16 / bf16 elements per piece
    gen = torch.Generator().manual_seed(0)
    state = {"t": torch.randn(7, 9, generator=gen).t(), "w": torch.randn(23, generator=gen)}
    torch.save(state, tmp_path / "src.pt")
    ckptkit.convert(tmp_path / "src.pt", tmp_path / "bf16.safetensors", dtype="bf16")
    out = load_file(tmp_path / "bf16.safetensors")
    for key, tensor in state.items():
        assert bit_equal(out[key], tensor.bfloat16().contiguous()), key
    late = torch.ones(23)
    late[-1] = 1e6  # inf in fp16, in the last (short) piece
    torch.save({"late": late}, tmp_path / "late.pt")
    with pytest.raises(CastError, match="inf in late"):
        ckptkit.convert(tmp_path / "late.pt", tmp_path / "h.safetensors", dtype="fp16")


def test_verification_catches_a_corrupted_cast(tmp_path, monkeypatch):
    real = transfer_module.write_all
    written = []

    def corrupting(fd, data):
        written.append(len(data))
        if len(written) == 2:  # the second piece of 'w'
            data = memoryview(bytes([data[0] ^ 1]) + bytes(data[1:]))
        real(fd, data)

    monkeypatch.setattr(transfer_module, "PIECE", 8)
    monkeypatch.setattr(transfer_module, "write_all", corrupting)
    torch.save({"w": torch.randn(12)}, tmp_path / "src.pt")
    with pytest.raises(VerificationError, match="'w' read back from .* differs from the source"):
        ckptkit.convert(tmp_path / "src.pt", tmp_path / "o.safetensors", dtype="bf16")
    assert written == [8, 8, 8] and not (tmp_path / "o.safetensors").exists()


def test_written_ranges_leave_the_page_cache_once_far_behind(tmp_path, monkeypatch):
    """Each written range has its write-back started at once and is released from the page
    cache again once RELEASE_AFTER bytes were written after it, or when the output is done
    (its descriptor then closed); the output stays exact."""
    real, calls = transfer_module.release_pages, []

    def recording(fd, offset, count):
        calls.append((offset, count))
        real(fd, offset, count)

    monkeypatch.setattr(transfer_module, "release_pages", recording)
    monkeypatch.setattr(transfer_module, "RELEASE_AFTER", 100)
    state = {f"t{i}": torch.full((16,), float(i)) for i in range(10)}  # 64 bytes each
    torch.save(state, tmp_path / "src.pt")
    ckptkit.convert(tmp_path / "src.pt", tmp_path / "out.safetensors")
    counts = Counter(calls)
    assert len(counts) == 10 and all(count == 64 for _, count in counts)
    offsets = sorted(counts)
    assert [counts[r] for r in offsets] == [2] * 10  # the last 128 bytes: when done
    out = load_file(tmp_path / "out.safetensors")
    assert all(torch.equal(out[k], v) for k, v in state.items())


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("5GB", 5 * 10**9),
        ("2GiB", 2 * 2**30),
        ("500MB", 5 * 10**8),
        ("1.5kb", 1500),
        ("4096", 4096),
        (123, 123),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["five", "5XB", "0", "-1GB"])
def test_parse_size_refuses(text):
    with pytest.raises(UsageError):
        parse_size(text)


def test_sharded_output_layout_and_round_trip(tmp_path):
    src = tmp_path / "m.pt"
    embed = torch.randn(64, 16)  # 4 kB, tied with the head
    state = {
        "embed": embed,
        "a": torch.randn(32, 16),
        "huge": torch.randn(128, 16),
        "b": torch.randn(32, 16),
        "head": embed,
        "steps": torch.tensor(3),
    }
    torch.save(state, src)
    out = tmp_path / "out"
    out.mkdir()
    report = ckptkit.convert(src, out / "model.safetensors", max_shard_size="5kB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == report.nbytes
    assert index["metadata"]["format"] == "pt"
    shards = {}
    for key, name in index["weight_map"].items():
        shards.setdefault(name, []).append(key)
    assert len(report.files) == len(shards) + 1
    assert all(name.startswith("model-000") and "-of-0000" in name for name in shards)
    # Tied: stored once, the other name recorded in that shard's metadata (as save_model does).
    assert "head" not in index["weight_map"]
    with safe_open(str(out / index["weight_map"]["embed"]), "pt") as f:
        assert f.metadata()["head"] == "embed"
    assert shards[index["weight_map"]["huge"]] == ["huge"]  # larger than the limit: alone
    for name, keys in shards.items():
        sizes = sum(load_file(out / name)[k].numel() * 4 for k in keys if k != "steps")
        assert sizes <= 5000 or keys in (["huge"], ["embed"])  # one unit over the limit
    copies = tmp_path / "copies"
    copies.mkdir()
    ckptkit.convert(src, copies / "model.safetensors", max_shard_size="5kB", keep_tied_copies=True)
    kept = json.loads((copies / "model.safetensors.index.json").read_text())["weight_map"]
    assert kept["embed"] == kept["head"]  # every name written, a tied group in one shard
    # Reading the shards back (folder or index), merging them, and diffing: all bit-exact.
    merged = tmp_path / "merged.safetensors"
    ckptkit.convert(out, merged)
    assert ckptkit.diff(out / "model.safetensors.index.json", src).equal
    assert ckptkit.diff(merged, src).equal


def test_sharded_output_is_all_or_nothing(tmp_path):
    src = tmp_path / "m.pt"
    torch.save({"a": torch.randn(64, 16), "b": torch.randn(64, 16)}, src)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"taken")
    with pytest.raises(
        ckptkit.CkptkitError, match="model-00002-of-00002.safetensors exists; pass force=True"
    ):
        ckptkit.convert(src, tmp_path / "model.safetensors", max_shard_size="4kB")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "m.pt",
        "model-00002-of-00002.safetensors",
    ]


def test_sharded_torch_bins_are_read(tmp_path):
    state = torch.load(FIXTURE_DIR / "single.pt", weights_only=True)
    keys = list(state)
    torch.save({k: state[k] for k in keys[:4]}, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save({k: state[k] for k in keys[4:]}, tmp_path / "pytorch_model-00002-of-00002.bin")
    weight_map = {
        k: f"pytorch_model-0000{1 if i < 4 else 2}-of-00002.bin" for i, k in enumerate(keys)
    }
    (tmp_path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    summary = ckptkit.summarize(tmp_path / "pytorch_model.bin.index.json")
    assert summary.format == "sharded torch-zip" and len(summary.tensors) == 9
    report = ckptkit.convert(tmp_path, tmp_path / "merged.safetensors")
    assert report.copied == 9
    assert ckptkit.diff(tmp_path / "merged.safetensors", FIXTURE_DIR / "single.pt").equal


def test_cli_dtype_and_shards(run, fixture_copy, tmp_path):
    fixture_copy("training.pt")
    result = run("convert", "training.pt", "half.safetensors", "--strip-module", "--dtype", "fp16")
    assert result.exit_code == 0, result.stderr
    assert "Cast     8 floating-point tensors: 230 B saved" in result.stdout.splitlines()
    result = run(
        "convert", "training.pt", "s.safetensors", "--strip-module", "--max-shard-size", "200B"
    )
    assert result.exit_code == 0, result.stderr
    assert "Wrote    3 shards and s.safetensors.index.json, verified bit-exact" in result.stdout
    bad = run("convert", "training.pt", "x.pt", "--max-shard-size", "1GB")
    assert bad.exit_code == 2
    assert (
        bad.stderr == "Error: --max-shard-size writes safetensors shards; give a .safetensors DST\n"
    )
