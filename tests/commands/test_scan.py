"""The static safety scan: hand-made malicious pickles caught, clean fixtures not flagged."""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile

import pytest
import torch
from helpers import FIXTURE_DIR, FIXTURES

from ckptkit.formats.pickles.verdicts import classify, scan_pickle
from ckptkit.scan import scan


class _Reduce:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


@pytest.mark.parametrize(
    "fx", [f for f in FIXTURES if not f.bad and not f.allow], ids=lambda f: f.name
)
def test_clean_fixtures_raise_no_alarm(fx):
    report = scan(FIXTURE_DIR / fx.name)
    assert report.verdict == "safe", report.to_dict()
    assert all(cls in ("safe", "data") for cls in report.globals().values())


@pytest.mark.parametrize("fx", [f for f in FIXTURES if f.allow], ids=lambda f: f.name)
def test_foreign_globals_are_unknown_or_dangerous_until_allowed(fx):
    report = scan(FIXTURE_DIR / fx.name)
    assert report.verdict == ("dangerous" if fx.bad else "unknown")
    assert {g for g, cls in report.globals().items() if cls != "safe"} == set(fx.allow)
    if not fx.bad:
        assert scan(FIXTURE_DIR / fx.name, allow_globals=fx.allow).verdict == "safe"


@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5])
def test_every_protocol_names_the_call(protocol, tmp_path):
    data = pickle.dumps({"w": 1, "x": _Reduce(os.system, "echo hi")}, protocol=protocol)
    found = scan_pickle(data)
    name = f"{os.system.__module__}.system"
    assert found.calls == {name: 1}
    assert found.verdict() == "dangerous"


def test_protocol_0_text_pickle_by_hand():
    data = b"cos\nsystem\n(S'echo pwned'\ntR."
    found = scan_pickle(data)
    assert found.globals == {"os.system": 1} and found.calls == {"os.system": 1}


def test_stack_global_from_memoised_strings():
    # Names pushed once, memoised, fetched back for STACK_GLOBAL: the scan follows the memo.
    data = b"\x80\x04\x8c\x08builtins\x94\x8c\x04eval\x94h\x00h\x01\x93\x8c\x011\x85R."
    found = scan_pickle(data)
    assert found.globals == {"builtins.eval": 1} and found.calls == {"builtins.eval": 1}


def test_stack_global_with_a_computed_name_is_dangerous():
    # The module name is the result of a call, known only at load time.
    data = (
        b"\x80\x04\x8c\x08builtins\x8c\x03str\x93\x8c\x02os\x85R\x8c\x06system\x93"
        b"\x8c\x04true\x85R."
    )
    found = scan_pickle(data)
    assert any(p.startswith("computed global") for p in found.problems)
    assert found.verdict() == "dangerous"


# getattr(__import__("os"), "system")("true"), by hand: each call works on what the last returned.
GETATTR_TRICK = (
    b"\x80\x02cbuiltins\ngetattr\ncbuiltins\n__import__\nX\x02\x00\x00\x00os\x85R"
    b"X\x06\x00\x00\x00system\x86RX\x04\x00\x00\x00true\x85R."
)


def test_getattr_trick_is_dangerous(tmp_path, monkeypatch):
    found = scan_pickle(GETATTR_TRICK)
    assert classify("builtins.getattr") == "dangerous"
    assert found.calls == {"builtins.getattr": 1, "builtins.__import__": 1}
    assert "call of a value made at load time (not a named global)" in found.problems
    assert found.verdict() == "dangerous"


def test_getattr_on_a_named_global_names_the_attribute_as_a_global():
    """getattr(<global os.path>, "os").system("true") reaches os.system through two lookups:
    each is named as the global it reaches and the call is one of os.path.os.system; getattr
    stays named too, and a dunder is never resolved."""
    reach = (
        b"\x80\x02cbuiltins\ngetattr\nq\x00cbuiltins\ngetattr\ncos\npath\n"
        b"X\x02\x00\x00\x00os\x86RX\x06\x00\x00\x00system\x86R"
    )
    found = scan_pickle(reach + b"X\x04\x00\x00\x00true\x85R.")
    assert {"builtins.getattr", "os.path", "os.path.os", "os.path.os.system"} <= set(found.globals)
    assert found.calls == {"os.path.os.system": 1}
    assert found.verdict() == "dangerous"
    dunder = b"\x80\x02cbuiltins\ngetattr\ncos\npath\nX\x08\x00\x00\x00__dict__\x86R."
    found = scan_pickle(dunder)
    assert "os.path.__dict__" not in found.globals and found.calls == {"builtins.getattr": 1}
    assert found.verdict() == "dangerous"


def test_pickle_hidden_in_a_second_zip_member(tmp_path):
    path = tmp_path / "hidden.pt"
    torch.save({"w": torch.ones(2)}, path)
    with zipfile.ZipFile(path, "a") as zf:
        zf.writestr("hidden/extra/payload", pickle.dumps(_Reduce(os.system, "true"), protocol=4))
    report = scan(path)
    assert report.verdict == "dangerous"
    hidden = next(p for p in report.pickles if p.label == "hidden/extra/payload")
    assert any(p.startswith("nested pickle") for p in hidden.problems)


def test_truncated_pickle_is_reported_not_raised():
    data = pickle.dumps({"a": [1, 2, 3]}, protocol=2)[:-6]
    found = scan_pickle(data)
    assert "truncated" in found.damaged and found.verdict() == "damaged"


def test_safetensors_and_plain_pickles(tmp_path):
    assert scan(FIXTURE_DIR / "single.safetensors").pickles == []
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps({"a": 1}) + pickle.dumps(_Reduce(eval, "1")))
    report = scan(plain)
    assert report.format == "pickle" and len(report.pickles) == 2
    assert report.verdict == "dangerous"


def test_scan_cli_exit_codes_and_json(run, fixture_copy):
    fixture_copy("single.pt")
    fixture_copy("malicious.pt")
    fixture_copy("unsafe_global.pt")
    ok = run("scan", "single.pt")
    assert ok.exit_code == 0 and ok.stdout.startswith("single.pt: safe (torch-zip)")
    bad = run("scan", "single.pt", "malicious.pt")
    assert bad.exit_code == 1
    assert "  dangerous builtins.exec" in bad.stdout.splitlines()
    assert "  call      builtins.exec(...) in malicious/data.pkl" in bad.stdout.splitlines()
    allowed = run("scan", "unsafe_global.pt", "--allow-global", "fractions.Fraction", "--json")
    assert allowed.exit_code == 0
    doc = json.loads(allowed.stdout)
    assert doc["schema"] == 2 and doc["verdict"] == "safe"
    assert doc["files"][0]["globals"]["fractions.Fraction"] == "allowed"
    missing = run("scan", "nope.pt")
    assert (
        missing.exit_code == 2
        and missing.stderr == "Error: nope.pt does not exist; check the path\n"
    )
    # An unreadable file does not stop the scan: every file is reported, the exit code is 2.
    both = run("scan", "nope.pt", "malicious.pt", "--json")
    assert both.exit_code == 2 and both.stderr.startswith("Error: nope.pt does not exist")
    doc = json.loads(both.stdout)
    assert doc["verdict"] == "error"
    assert [(f["path"], f["verdict"]) for f in doc["files"]] == [
        ("nope.pt", "error"),
        ("malicious.pt", "dangerous"),
    ]
    assert doc["files"][0]["error"] == "nope.pt does not exist; check the path"
    assert run("scan", "malicious.pt", "-q").stdout == ""


def test_hostile_pickle_that_breaks_the_reader_is_still_refused_as_unsafe(tmp_path):
    import ckptkit
    from ckptkit.errors import UnsafeCheckpointError

    path = tmp_path / "trick.pt"
    torch.save({"w": torch.ones(2)}, path)
    with zipfile.ZipFile(path) as zf:
        members = {i.filename: zf.read(i) for i in zf.infolist()}
    pkl = next(n for n in members if n.endswith("data.pkl"))
    members[pkl] = GETATTR_TRICK  # calling what a call returned breaks the static reader
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    path.write_bytes(buf.getvalue())
    with pytest.raises(UnsafeCheckpointError, match="builtins.getattr"):
        ckptkit.open_source(path)


def test_safe_set_is_torchs_own_allow_list():
    """The torch-free table equals torch's weights_only allow-list (regenerate it with
    `python -m ckptkit.formats.pickles.safe_globals` when torch changes)."""
    from ckptkit.formats.pickles.safe_globals import TORCH_SAFE_GLOBALS, generate

    assert set(generate()) == TORCH_SAFE_GLOBALS
    for name in ("torch.FloatTensor", "torch.int4", "torch.cuda.sparse.HalfTensor"):
        assert classify(name) == "safe"
    assert classify("fractions.Fraction") == "unknown"  # torch does not admit it either


def test_names_registered_with_torch_count_as_safe():
    import fractions

    from ckptkit.formats.pickles.safe_globals import safe_globals

    assert "fractions.Fraction" not in safe_globals()
    with torch.serialization.safe_globals([fractions.Fraction]):
        assert "fractions.Fraction" in safe_globals()
        assert scan(FIXTURE_DIR / "unsafe_global.pt").verdict == "safe"
    assert scan(FIXTURE_DIR / "unsafe_global.pt").verdict == "unknown"
