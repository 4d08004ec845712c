"""The scanner against hostile files: every live payload is proven live by the loader it targets
(in a subprocess), and ckptkit never calls it safe, never runs it, and refuses to read it."""

from __future__ import annotations

import io
import json
import pickle
import re
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch
from helpers import FIXTURE_DIR, FIXTURES, ROOT, bits, same_tree
from hostile import CASES

import ckptkit
from ckptkit.errors import CkptkitError, UnsafeCheckpointError
from ckptkit.formats.pickles.unpickler import read_pickle
from ckptkit.scan import scan

LIVE = {name for name, (_, loader) in CASES.items() if loader != "none"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    for name, (build, _) in CASES.items():
        (folder / f"{name}.bin").write_bytes(build())
    return folder


def test_every_live_payload_runs_in_the_loader_it_targets(corpus, tmp_path):
    """Proof the corpus is real: each payload creates 'pwned' when its loader reads the file."""
    script = textwrap.dedent(
        """
        import io, json, os, pickle, sys, zipfile, warnings
        import torch
        warnings.simplefilter("ignore")
        results = {}
        for name, loader in json.loads(sys.argv[1]).items():
            src = os.path.abspath(os.path.join(sys.argv[2], name + ".bin"))
            os.makedirs(name); os.chdir(name)
            try:
                if loader == "torch":
                    torch.load(src, weights_only=False)
                elif loader == "pickle":
                    with open(src, "rb") as f:
                        pickle.load(f)
                elif loader == "pickle-stream":
                    with open(src, "rb") as f:
                        pickle.load(io.BytesIO(f.read()))
                elif loader == "pickle.loads":
                    with open(src, "rb") as f:
                        pickle.loads(f.read())
                else:
                    with zipfile.ZipFile(src) as zf:
                        for member in zf.namelist():
                            if member.endswith(".pkl"):
                                try:
                                    pickle.loads(zf.read(member))
                                except Exception:
                                    pass
            except BaseException:
                pass
            results[name] = os.path.exists("pwned")
            os.chdir("..")
        print(json.dumps(results))
        """
    )
    loaders = {name: loader for name, (_, loader) in CASES.items() if loader != "none"}
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(loaders), str(corpus)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    ran = json.loads(out.stdout.strip().splitlines()[-1])
    assert ran == dict.fromkeys(loaders, True)


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_hostile_file_is_called_safe(corpus, name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    report = scan(corpus / f"{name}.bin")
    assert report.verdict == "dangerous", report.to_dict()
    with pytest.raises(CkptkitError):
        ckptkit.open_source(corpus / f"{name}.bin")
    ckptkit.scan(corpus / f"{name}.bin", allow_globals=["fractions.Fraction"])
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(
    ("name", "finding"),
    [
        ("frame_short", "frame boundaries disagree"),
        ("frame_nested", "a frame starts inside another"),
        ("tar_pickle_polyglot", "polyglot"),
        ("legacy_tar_polyglot", "polyglot"),
        ("safetensors_lookalike", "polyglot"),
        ("zip_at_end", "polyglot"),
        ("hidden_member", "nested pickle in zip member 'archive/extra.pkl'"),
        ("build_poison", "BUILD on torch.FloatStorage itself"),
        ("computed_global", "computed global"),
        ("extension_code", "extension code 1"),
    ],
)
def test_the_technique_is_named(corpus, name, finding):
    report = scan(corpus / f"{name}.bin")
    text = json.dumps(report.to_dict())
    assert finding in text


def test_polyglot_names_each_reading(corpus):
    report = scan(corpus / "tar_pickle_polyglot.bin")
    assert report.format == "legacy-tar"
    assert [r["kind"] for r in report.to_dict()["readings"]] == ["legacy-tar", "pickle"]
    assert report.globals()["builtins.exec"] == "dangerous"


def test_no_state_survives_between_files(corpus, tmp_path):
    """A pickle that BUILDs on a safe global's stand-in changes nothing for the next file."""
    poisoned = read_pickle(CASES["build_poison"][0]())
    assert poisoned.run.problems == [
        "BUILD on torch.FloatStorage itself (it would change the global)"
    ]
    with pytest.raises(UnsafeCheckpointError, match="BUILD on torch.FloatStorage"):
        ckptkit.open_source(corpus / "build_poison.bin")
    # Then a clean file in the same process: its float32 storages are float32.
    dst = tmp_path / "clean.safetensors"
    ckptkit.convert(FIXTURE_DIR / "single.pt", dst)
    from safetensors.torch import load_file

    out = load_file(dst)
    ref = torch.load(FIXTURE_DIR / "single.pt", weights_only=True)
    assert {k: v.dtype for k, v in out.items()} == {k: v.dtype for k, v in ref.items()}
    assert all(torch.equal(out[k], ref[k]) for k in ref)


def test_poison_inside_a_checkpoint_does_not_change_its_own_dtype(tmp_path):
    """The same BUILD inside a real checkpoint's pickle: refused, and a static read (check off)
    still sees float32 storages."""
    state = {"w": torch.arange(4, dtype=torch.float32)}
    path = tmp_path / "a.pt"
    torch.save(state, path, _use_new_zipfile_serialization=True)
    import zipfile

    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if n.endswith("data.pkl"))
        members = {n: zf.read(n) for n in zf.namelist()}
    poison = b"ctorch\nFloatStorage\n}X\x05\x00\x00\x00dtypeX\x05\x00\x00\x00int32sb0"
    members[name] = members[name][:2] + poison + members[name][2:]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for n, data in members.items():
            zf.writestr(n, data)
    with pytest.raises(UnsafeCheckpointError):
        ckptkit.open_source(path)
    with ckptkit.open_source(path, check_safety=False) as source:
        assert source.entries()[0][1].dtype == "float32"
        assert torch.equal(source.load("w"), state["w"])


@pytest.mark.parametrize("fx", [f for f in FIXTURES if not f.bad], ids=lambda f: f.name)
def test_benign_fixtures_that_torch_accepts_are_not_flagged(fx):
    path = FIXTURE_DIR / fx.name
    if fx.name.endswith(".safetensors"):
        assert scan(path).verdict == "safe"
        return
    try:
        torch.load(path, weights_only=True, map_location="cpu")
    except Exception:  # torch refuses it: plain data (NumPy scalars) may still be safe to read
        assert scan(path).verdict in ("safe", "unknown")
        return
    assert scan(path).verdict == "safe"


# The legacy storage classes a state dict's persistent ids name, by name (asking a class its
# dtype warns that typed storages are deprecated).
_STORAGE_DTYPES = {
    "FloatStorage": torch.float32,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
}


def _plain_pickle_load(path) -> dict:
    """A zip ``.pt`` read with the standard library's pickle alone (the file is ours, so
    trusted): each persistent id (a tuple; at protocol 0 the tuple's ``str``, which torch's own
    loaders refuse) names a record under ``data/``; tensors are rebuilt over its bytes."""
    with zipfile.ZipFile(path) as archive:
        prefix = archive.namelist()[0].split("/")[0]

        def storage(pid):
            if isinstance(pid, str):  # "('storage', <class 'torch.FloatStorage'>, '0', 'cpu', 12)"
                kind, key = re.fullmatch(
                    r"\('storage', <class 'torch\.(\w+)'>, '(\w+)'.*", pid
                ).groups()
            else:
                _, kind, key, _, _ = pid
                kind = kind.__name__
            data = archive.read(f"{prefix}/data/{key}")
            untyped = torch.UntypedStorage.from_buffer(data, dtype=torch.uint8) if data else None
            return untyped, _STORAGE_DTYPES[kind]

        def rebuild(stored, offset, size, stride, *_):
            untyped, dtype = stored
            if untyped is None:
                return torch.empty(size, dtype=dtype)
            return torch.empty(0, dtype=dtype).set_(untyped, offset, size, stride)

        class Reader(pickle.Unpickler):
            def persistent_load(self, pid):
                return storage(pid)

            def find_class(self, module, name):
                if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
                    return rebuild
                return super().find_class(module, name)

        return Reader(io.BytesIO(archive.read(f"{prefix}/data.pkl"))).load()


@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5])
@pytest.mark.parametrize("legacy", [False, True])
def test_benign_saves_at_every_protocol(tmp_path, protocol, legacy):
    """torch.save at every pickle protocol, judged and read against a reference that reads
    them all: torch's full unpickler (torch.load(weights_only=False): the file is ours), and
    at protocol 0, which torch cannot read back, the standard library's pickle."""
    weights = {
        "w": torch.randn(3, 4),
        "b": torch.zeros(2, dtype=torch.bfloat16),
        "i": torch.arange(5),
        "t": torch.randn(4, 3).t(),
    }
    meta = {
        "epoch": 3,
        "lr": 0.1,
        "zero": -0.0,
        "name": "run é✓",
        "flags": [True, None, False],
        "big": 2**70,
        "negative": -(2**40),
    }
    state = {"model": weights, "meta": meta}
    path = tmp_path / "x.pt"
    if legacy and protocol < 2:
        pytest.skip("torch's legacy format writes its magic number with protocol >= 2")
    torch.save(state, path, pickle_protocol=protocol, _use_new_zipfile_serialization=not legacy)
    if not legacy:
        plain = _plain_pickle_load(path)
        assert same_tree(plain["meta"], meta) and [bits(v) for v in plain["model"].values()] == [
            bits(v) for v in weights.values()
        ]
    if protocol == 0:
        # Protocol 0 writes each persistent id as its str(): torch's own loaders refuse the
        # file, and so does ckptkit, as unreadable, never as unsafe and never read wrongly.
        with pytest.raises((AssertionError, pickle.UnpicklingError), match="must be a tuple"):
            torch.load(path, weights_only=False)
        assert scan(path).verdict == "damaged"
        with pytest.raises(CkptkitError, match="persistent id"):
            ckptkit.open_source(path)
        return
    loaded = torch.load(path, weights_only=False)
    assert same_tree(loaded["meta"], meta) and [bits(v) for v in loaded["model"].values()] == [
        bits(v) for v in weights.values()
    ]
    assert scan(path).verdict == "safe"
    with ckptkit.open_source(path) as source:
        assert source.selected == "model" and same_tree(source.extras["meta"], loaded["meta"])
        assert source.keys() == list(loaded["model"])
        for key, tensor in loaded["model"].items():
            assert bits(source.load(key)) == bits(tensor), key


def test_plain_pickle_at_every_protocol_is_read_and_judged(tmp_path):
    for protocol in range(6):
        path = tmp_path / f"p{protocol}.pkl"
        path.write_bytes(pickle.dumps({"a": [1, 2.5, "x", b"y"], "b": (None, True)}, protocol))
        report = scan(path)
        assert report.format == "pickle" and report.verdict == "safe", protocol


def test_allow_global_refuses_names_that_run_code(run, corpus):
    result = run("scan", corpus / "p2_reduce.bin", "--allow-global", "builtins.exec")
    assert result.exit_code == 2
    assert result.stderr == (
        "Error: builtins.exec cannot be admitted: a file that needs it runs code when loaded; "
        "only if you trust the file, load it with --trust\n"
    )
    for name in (
        "os.system",
        "subprocess.Popen",
        "builtins.getattr",
        "runpy._run_code",
        "importlib.import_module",
        "torch.load",
        "pickle.loads",
        "sys.modules",
    ):
        with pytest.raises(CkptkitError, match="cannot be admitted.*trust=True"):
            ckptkit.scan(FIXTURE_DIR / "single.pt", allow_globals=[name])


def test_scan_runs_no_code_even_in_a_subprocess_cli(corpus, tmp_path):
    files = [str(corpus / f"{name}.bin") for name in sorted(CASES)]
    out = subprocess.run(
        [sys.executable, "-m", "ckptkit", "scan", "--json", *files],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 1, out.stderr
    doc = json.loads(out.stdout)
    assert {f["verdict"] for f in doc["files"]} == {"dangerous"}
    assert not (tmp_path / "pwned").exists()


def test_a_zip_with_two_members_of_one_name_is_not_safe(tmp_path):
    import warnings
    import zipfile

    path = tmp_path / "twice.pt"
    torch.save({"w": torch.ones(2)}, path)
    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if n.endswith("data.pkl"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate name
        with zipfile.ZipFile(path, "a") as zf:
            zf.writestr(name, pickle.dumps({"w": 1}, protocol=2))
    report = scan(path)
    assert report.verdict == "dangerous"
    assert "a second member by this name" in json.dumps(report.to_dict())
