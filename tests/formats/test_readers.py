"""Static reading: structure and bytes equal torch's own loader, and nothing is executed."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import zipfile

import pytest
import torch
from helpers import FIXTURE_DIR, FIXTURES, ROOT

import ckptkit
from ckptkit.errors import FormatError, SelectError, UnsafeCheckpointError, UsageError
from ckptkit.formats import detect_format, open_source
from ckptkit.formats.base.dtypes import TensorSpec
from ckptkit.formats.base.tensors import bit_equal, dtype_name
from ckptkit.formats.files.safetensors import header_bytes, write_tensors
from ckptkit.formats.pickles.unpickler import OpaqueObject, TensorStub, read_pickle
from ckptkit.scan import scan

TORCH_FIXTURES = [f for f in FIXTURES if not f.name.endswith(".safetensors")]


def torch_reference(fx):
    """The selected state dict as torch.load gives it (our own fixtures, so trusted; NumPy
    scalars need the full unpickler)."""
    trusted = bool(fx.allow) or fx.name == "numpy_scalar.pt"
    obj = torch.load(FIXTURE_DIR / fx.name, map_location="cpu", weights_only=not trusted)
    for part in filter(None, fx.selected.split(".")):
        obj = obj[part]
    return obj


@pytest.mark.parametrize("fx", [f for f in TORCH_FIXTURES if not f.bad], ids=lambda f: f.name)
def test_static_reader_matches_torch_load(fx):
    expected = torch_reference(fx)
    with open_source(FIXTURE_DIR / fx.name, allow_globals=fx.allow) as source:
        assert source.selected == fx.selected
        entries = dict(source.entries())
        assert list(entries) == list(expected)
        for key, tensor in expected.items():
            info = entries[key]
            assert (info.dtype, info.shape) == (dtype_name(tensor.dtype), tuple(tensor.shape))
            assert info.contiguous == tensor.is_contiguous()
            loaded = source.load(key)
            assert loaded.stride() == tensor.stride()
            assert bit_equal(loaded, tensor), key


def test_views_of_one_buffer_keep_their_own_ranges():
    with open_source(FIXTURE_DIR / "flat_buffer.pt") as source:
        entries = dict(source.entries())
    floats = [i for i in entries.values() if i.dtype == "float32"]
    assert len({i.storage for i in floats}) == 1  # one shared buffer...
    ranges = sorted(i.byte_range for i in floats)
    assert all(
        a[1] <= b[0] for a, b in zip(ranges, ranges[1:], strict=False)
    )  # ...in disjoint slices
    with open_source(FIXTURE_DIR / "flat_buffer.pt") as source:
        assert not source.aliases()


def test_tied_weights_are_aliases():
    with open_source(FIXTURE_DIR / "tied.pt") as source:
        assert source.aliases() == {"head.weight": "embed.weight"}


def test_numpy_scalars_are_decoded_without_numpy_or_flags():
    with open_source(FIXTURE_DIR / "numpy_scalar.pt") as source:  # plain data: no flag needed
        assert source.extras == {"best_acc": 0.93, "epochs": 7}


def test_training_checkpoint_extras_and_dropped_parts():
    with open_source(FIXTURE_DIR / "training.pt") as source:
        assert source.selected_reason == "found by its name"
        assert source.extras["epoch"] == 3
        assert source.extras["args"] == {"lr": 1e-3, "batch_size": 32, "arch": "tiny"}
        assert source.extras["scheduler"]["step_size"] == 2
        (dropped,) = source.dropped
        assert dropped.path == "optimizer" and dropped.tensors > 0


def test_select_overrides_and_explains(tmp_path):
    with open_source(FIXTURE_DIR / "ema.pt", select="model_ema") as source:
        assert "n_averaged" in source.keys()
    with pytest.raises(
        SelectError, match="no 'nope' in the checkpoint; available here: model, model_ema, epoch"
    ):
        open_source(FIXTURE_DIR / "ema.pt", select="nope")
    with pytest.raises(SelectError, match="'epoch' in .* is not a state dict"):
        open_source(FIXTURE_DIR / "ema.pt", select="epoch")
    path = tmp_path / "no_weights.pt"
    torch.save({"epoch": 1, "note": "x"}, path)
    with open_source(path) as source:  # described (inspect shows it); convert refuses it
        assert source.keys() == [] and source.extras == {"epoch": 1, "note": "x"}
        assert source.selected_reason == "holds no tensors: a mapping of 2 plain values"


def test_state_dict_found_anywhere_as_a_last_resort(tmp_path):
    path = tmp_path / "odd.pt"
    torch.save({"stuff": {"deep": {"w": torch.ones(2)}}, "epoch": 1}, path)
    with open_source(path) as source:
        assert source.selected == "stuff.deep"
        assert "--select" in source.selected_reason


@pytest.mark.parametrize("name", ["malicious.pt", "malicious_legacy.pt"])
def test_malicious_pickle_is_refused_and_never_runs(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsafeCheckpointError) as err:
        open_source(FIXTURE_DIR / name)
    assert err.value.globals == ("builtins.exec",)
    assert str(err.value).endswith("only a file you trust can be loaded, with trust=True")
    # A name that runs code cannot be admitted at all...
    with pytest.raises(UsageError, match="builtins.exec cannot be admitted.*trust=True"):
        open_source(FIXTURE_DIR / name, allow_globals=["builtins.exec"])
    # ...and read without the safety check (as inspect does), the global is only recorded.
    with open_source(FIXTURE_DIR / name, check_safety=False) as source:
        assert source.extras["payload"]["__class__"] == "builtins.exec"
        assert len(source.keys()) == 9
    assert not (tmp_path / "ckptkit_pwned").exists()


def test_trust_runs_torch_unpickler_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with open_source(FIXTURE_DIR / "unsafe_global.pt", trust=True) as source:
        assert "fractions.Fraction" in source.globals
        assert len(source.keys()) == 9
    open_source(FIXTURE_DIR / "malicious.pt", trust=True).close()
    assert (tmp_path / "ckptkit_pwned").exists()  # proof that --trust is what it says


class _System:
    def __reduce__(self):
        return (os.system, ("echo pwned > ckptkit_pwned",))


@pytest.mark.parametrize("protocol", [0, 1, 2, 4, 5])
def test_hand_made_pickles_are_read_not_run(protocol, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = pickle.dumps({"x": _System(), "n": [1, 2.5, "s", b"b"]}, protocol=protocol)
    scan = read_pickle(data)
    assert scan.unsafe_globals == [f"{os.system.__module__}.system"]
    assert isinstance(scan.root["x"], OpaqueObject)
    assert scan.root["n"] == [1, 2.5, "s", b"b"]
    assert not (tmp_path / "ckptkit_pwned").exists()


def test_stack_global_with_computed_names_is_still_recorded():
    # Protocol 4 STACK_GLOBAL takes module and name from the stack: build it by hand.
    data = (
        b"\x80\x04"
        + b"\x8c\x02os"
        + b"\x94"
        + b"\x8c\x06system"
        + b"\x94"
        + b"\x93"
        + b"\x8c\x04true"
        + b"\x85"
        + b"R"
        + b"."
    )
    scan = read_pickle(data)
    assert scan.globals == ["os.system"]
    assert isinstance(scan.root, OpaqueObject) and scan.root.args == ("true",)


def test_tensor_stub_geometry():
    data = io.BytesIO()
    torch.save({"t": torch.arange(12.0).view(3, 4).t()[1:]}, data)
    with zipfile.ZipFile(data) as zf:
        pkl = next(n for n in zf.namelist() if n.endswith("data.pkl"))
        stub = read_pickle(zf.read(pkl)).root["t"]
    assert isinstance(stub, TensorStub)
    assert (stub.shape, stub.stride, stub.offset, stub.is_contiguous) == ((3, 3), (1, 4), 1, False)
    assert stub.byte_range() == (4, 48)  # elements 1 .. 1 + 2*1 + 2*4 = 11


def test_reading_headers_does_not_import_torch():
    code = (
        "import sys, ckptkit\n"
        "from ckptkit.formats import open_source\n"
        f"s = open_source({str(FIXTURE_DIR / 'training.pt')!r}); s.entries(); s.aliases()\n"
        f"t = open_source({str(FIXTURE_DIR / 'single.safetensors')!r}); t.entries()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_damaged_files(tmp_path):
    data = (FIXTURE_DIR / "legacy_dp.pt").read_bytes()
    (tmp_path / "cut_legacy.pt").write_bytes(data[: len(data) - 40])
    with pytest.raises(FormatError, match="cut_legacy.pt is truncated; copy or download it again"):
        open_source(tmp_path / "cut_legacy.pt")
    zdata = (FIXTURE_DIR / "single.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(zdata[: len(zdata) // 2])
    with pytest.raises(FormatError, match="cut.pt is a truncated or damaged zip file"):
        open_source(tmp_path / "cut.pt")
    sdata = (FIXTURE_DIR / "single.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(sdata[:-10])
    with pytest.raises(FormatError, match="cut.safetensors is truncated"):
        open_source(tmp_path / "cut.safetensors")


@pytest.mark.parametrize("header_length", [0x280, 0x380, 0x480, 0x580])
def test_safetensors_whose_length_looks_like_a_pickle_opcode(tmp_path, header_length):
    # Pad the metadata so the 8-byte header length starts with b"\x80\x02" (a pickle's PROTO 2).
    spec = [TensorSpec("w", "float32", (2,))]
    pad = next(
        n
        for n in range(header_length)
        if len(header_bytes(spec, {"p": "x" * n})) == 8 + header_length
    )
    path = tmp_path / "odd.safetensors"
    write_tensors(path, {"w": torch.ones(2)}, {"p": "x" * pad})
    assert (
        path.read_bytes()[:2]
        == bytes([header_length & 0xFF, header_length >> 8])
        == b"\x80" + bytes([header_length >> 8])
    )
    assert detect_format(path) == "safetensors"


def test_plain_data_objects_are_decoded_without_flags(tmp_path, monkeypatch):
    """A timm-style training checkpoint: args as argparse.Namespace, NumPy values, a path, a
    time, collections: read without --allow-global, nothing imported or run."""
    import argparse
    import collections
    import datetime
    import pathlib

    import numpy as np

    monkeypatch.chdir(tmp_path)
    weights = {"w": torch.arange(4.0)}
    checkpoint = {
        "state_dict": weights,
        "state_dict_ema": {"w": torch.arange(4.0) * 2},
        "args": argparse.Namespace(model="resnet50", lr=0.1, output=pathlib.PurePosixPath("out")),
        "best": np.float64(0.75),
        "arr": np.arange(6, dtype=np.int32).reshape(2, 3),
        "when": datetime.datetime(2026, 11, 23, 5, 30),
        "took": datetime.timedelta(seconds=90),
        "counts": collections.defaultdict(int, {"a": 2}),
        "recent": collections.deque([1, 2], maxlen=3),
        "tags": frozenset({"x"}),
    }
    path = tmp_path / "timm.pth.tar"
    torch.save(checkpoint, path)
    with pytest.raises(pickle.UnpicklingError):  # torch's own weights_only loader refuses it
        torch.load(path, weights_only=True)
    with open_source(path) as source:
        assert source.selected == "state_dict" and torch.equal(source.load("w"), weights["w"])
        extras = source.extras
    assert extras["args"]["__class__"] == "argparse.Namespace" and extras["args"]["lr"] == 0.1
    assert extras["args"]["output"] == "out"
    assert extras["best"] == 0.75
    assert extras["arr"] == {"__class__": "numpy.ndarray", "shape": [2, 3], "dtype": "i4"}
    assert extras["when"] == "2026-11-23T05:30:00" and extras["took"] == "0:01:30"
    assert extras["counts"] == {"a": 2} and extras["recent"] == [1, 2]
    report = scan(path)
    assert report.verdict == "safe"
    assert report.globals()["argparse.Namespace"] == "data"
    assert report.globals()["pathlib.PurePosixPath"] == "data"
    assert not (tmp_path / "pwned").exists()


def test_data_classes_are_names_not_modules(tmp_path):
    """Only the exact data classes decode: pathlib's functions stay dangerous."""
    from ckptkit.formats.pickles.verdicts import classify

    assert classify("pathlib.PosixPath") == "data"
    assert classify("pathlib.Path.write_text") == "dangerous"
    assert classify("argparse.ArgumentParser") == "unknown"


def test_ema_copies_are_listed_and_taken_with_ema(tmp_path, run, fixture_copy):
    summary = ckptkit.summarize(FIXTURE_DIR / "ema.pt")
    assert [(c.path, c.is_ema) for c in summary.candidates] == [
        ("model", False),
        ("model_ema", True),
    ]
    assert summary.selected_reason == (
        "found by its name; an EMA copy is at 'model_ema' (--ema takes it)"
    )
    report = ckptkit.convert(FIXTURE_DIR / "ema.pt", tmp_path / "e.safetensors", ema=True)
    assert report.selected == "model_ema" and "--ema" in report.selected_reason
    # timm: state_dict and state_dict_ema beside each other.
    timm = tmp_path / "timm.pth.tar"
    torch.save(
        {"state_dict": {"w": torch.ones(2)}, "state_dict_ema": {"w": torch.zeros(2)}, "epoch": 3},
        timm,
    )
    with open_source(timm, ema=True) as source:
        assert source.selected == "state_dict_ema" and torch.equal(source.load("w"), torch.zeros(2))
    fixture_copy("single.pt")
    result = run("convert", "single.pt", "x.safetensors", "--ema")
    assert result.exit_code == 1
    assert result.stderr == (
        "Error: single.pt holds no EMA copy of the weights (weights found: the top level); "
        "drop --ema, or name the part with --select DOTTED.PATH\n"
    )
    fixture_copy("ema.pt")
    lines = run("inspect", "ema.pt").stdout.splitlines()
    assert (
        "weights     'model' (main weights, by name, 9 tensors; taken); 'model_ema' (an EMA "
        "copy, 10 tensors; --ema)" in lines
    )
