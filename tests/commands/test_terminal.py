"""Text from files reaches the terminal escaped: keys, global names, metadata and member names
holding ESC, CR, NUL, BEL or bytes that are not UTF-8 go through inspect, scan, diff and convert
(text and --json), and stdout and stderr carry no control character but the newline, nothing can
rewrite the line that says ``dangerous``, and JSON parses."""

from __future__ import annotations

import json
import pickle
import re
import struct

import pytest
import torch
from hostile import CASES, p2_reduce, torch_zip
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from ckptkit import render
from ckptkit.render import document
from ckptkit.text import escape

# What no output may hold: C0 controls but the newline, DEL, C1, bidi controls, line and
# paragraph separators, surrogates.
UNSAFE = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")

ESC_KEY = "enc.\x1b[2K\rsafe\x07.weight"  # erase the line, go back to its start, ring
NUL_KEY = "enc.nul\x00cr\r.bias"
BAD_KEY = "enc.bad\udcff\ud800.weight"  # a byte that was not UTF-8, a lone surrogate
UNI_KEY = "enc.é中文.weight"  # printable: shown as it is
BS_KEY = "enc.back\\slash.weight"
KEYS = [ESC_KEY, NUL_KEY, BAD_KEY, UNI_KEY, BS_KEY]
# A global that, printed raw, goes up a line, erases "dangerous" and writes "safe" there.
EVIL = "exec\x1b[1A\x1b[2K\r  safe      all good"


def unescape(text: str) -> str:
    """The inverse of ``escape`` (tests only)."""

    def one(m: re.Match[str]) -> str:
        token = m.group(1)
        if token == "\\":
            return "\\"
        code = int(token[1:], 16)
        return chr(0xDC00 + code) if token[0] == "x" and code >= 0x80 else chr(code)

    return re.sub(r"\\(\\|x[0-9a-f]{2}|u[0-9a-f]{4})", one, text)


def clean(data: bytes) -> str:
    """Output as text: valid UTF-8 with no control character but the newline."""
    text = data.decode("utf-8")  # strict: bytes that are not UTF-8 fail here
    found = UNSAFE.search(text)
    assert found is None, f"{found.group()!r} in {text!r}"
    return text


def checked(result, *, code: int | None = 0) -> tuple[str, str]:
    """stdout and stderr of a CliRunner result, both clean; the exit code when given."""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert code is None or result.exit_code == code, (result.stdout, result.stderr)
    return clean(result.stdout_bytes), clean(result.stderr_bytes)


def loaded(result) -> dict:
    out, _ = checked(result, code=None)
    assert out.isascii()  # ensure_ascii, as ever
    return json.loads(out)


def _unicode(text: str) -> bytes:
    # SHORT_BINUNICODE, encoded as pickle encodes str (lone surrogates kept, surrogatepass)
    raw = text.encode("utf-8", "surrogatepass")
    return b"\x8c" + bytes([len(raw)]) + raw


@pytest.fixture
def files(tmp_path):
    """The hostile files, written into tmp_path (the folder the `run` fixture runs in)."""
    torch.save({k: torch.full((2,), float(i)) for i, k in enumerate(KEYS)}, tmp_path / "keys.pt")
    other = [ESC_KEY, NUL_KEY, UNI_KEY, "only.\x1bB"]
    torch.save({k: torch.full((3,), 1.0) for k in other}, tmp_path / "keys2.pt")
    torch.save(
        {
            "model": {k: torch.ones(2) for k in KEYS},
            "note\x1b[31m": "value\x1b[2K\r\nsafe      nothing",
            "bad\udcff": 1,
        },
        tmp_path / "train.pt",
    )
    save_file(
        {k: torch.ones(2) for k in (ESC_KEY, NUL_KEY, UNI_KEY)},
        str(tmp_path / "m.safetensors"),
        metadata={"k\x1b[2K": "v\r\x07é", "lang": "中文"},
    )
    # A pickle naming builtins.exec, the line-rewriting global, and one not UTF-8.
    evil = (
        b"\x80\x04"
        + _unicode("builtins")
        + _unicode("exec")
        + b"\x93"
        + _unicode("builtins")
        + _unicode(EVIL)
        + b"\x93"
        + _unicode("x\udcff")
        + _unicode("y")
        + b"\x93\x87."
    )
    (tmp_path / "evil.pkl").write_bytes(evil)
    benign = pickle.dumps({"a": 1}, protocol=2)
    member = "archive/\x1b[2K\rx.pkl"
    (tmp_path / "member.pt").write_bytes(torch_zip(benign, {member: p2_reduce()}))
    # A bit flip in a member's name, the same in its local and central headers: '.' -> SO.
    flipped = bytearray(torch_zip(benign, {"archive/extra.pkl": p2_reduce()}))
    for at in [m.start() for m in re.finditer(rb"archive/extra\.pkl", flipped)]:
        flipped[at + len("archive/extra")] ^= 0x20
    (tmp_path / "flipped.pt").write_bytes(bytes(flipped))
    return tmp_path


# The escaping function


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("layer.0.weight", "layer.0.weight"),
        ("é中文🙂", "é中文🙂"),
        ("a\x1b[2K\rb", "a\\x1b[2K\\x0db"),
        ("nul\x00bel\x07del\x7f", "nul\\x00bel\\x07del\\x7f"),
        ("line\nbreak\ttab", "line\\x0abreak\\x09tab"),
        ("back\\slash \\x1b", "back\\\\slash \\\\x1b"),
        (b"\xff\xfeok".decode("utf-8", "surrogateescape"), "\\xff\\xfeok"),
        ("lone\ud800", "lone\\ud800"),
        ("c1\x85\x9b", "c1\\u0085\\u009b"),
        ("bidi\u202eevil\u2066\u2028", "bidi\\u202eevil\\u2066\\u2028"),
    ],
)
def test_escape(raw, shown):
    assert escape(raw) == shown
    assert unescape(shown) == raw


ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()))
SURROGATE_HEAVY = st.text(
    st.one_of(
        st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
        st.characters(max_codepoint=0xFF),
        st.sampled_from("\\x\\u1b"),
    )
)


@given(st.one_of(ANY_TEXT, SURROGATE_HEAVY))
def test_escaped_text_is_safe_utf8_and_unambiguous(text):
    shown = escape(text)
    assert not UNSAFE.search(shown)
    shown.encode("utf-8")  # no surrogate left
    assert unescape(shown) == text  # so no two strings are shown alike


PRINTABLE = st.text(
    st.characters(categories=("L", "M", "N", "P", "S"), exclude_characters="\\") | st.just(" ")
)


@given(PRINTABLE)
def test_printable_text_is_unchanged(text):
    assert text.isprintable()
    assert escape(text) == text


@given(st.dictionaries(ANY_TEXT, st.one_of(ANY_TEXT, st.lists(SURROGATE_HEAVY), st.integers())))
def test_json_document_is_valid_utf8_and_keeps_valid_strings(body):
    def valid(s):
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True

    text = document("scan", {"files": body})
    text.encode("utf-8")
    parsed = json.loads(text)["files"]
    expected = {}
    for key, value in body.items():
        shown = value
        if isinstance(value, str):
            shown = value if valid(value) else escape(value)
        elif isinstance(value, list):
            shown = [v if valid(v) else escape(v) for v in value]
        expected[key if valid(key) else escape(key)] = shown
    assert parsed == expected


def test_escaping_twice_escapes_once():
    once = escape("a\\b\x1b")
    assert once == "a\\\\b\\x1b" and escape(once) == once
    assert escape(str(once)) == "a\\\\\\\\b\\\\x1b"  # plain text: escaped, as any


def test_the_cli_prints_every_line_escaped(capsys):
    """Lines built outside the views (plot's, a new view's) are escaped where they are printed;
    a view's lines, already escaped, are printed as they are."""
    from ckptkit.cli import _echo

    _echo([escape("a\\b"), "raw\x1b[2K\\"])
    assert capsys.readouterr().out == "a\\\\b\nraw\\x1b[2K\\\\\n"


def test_every_view_escapes_its_lines():
    """Each public view is wrapped by the escaping, so a new line cannot skip it."""
    views = [n for n in dir(render) if n.endswith("_lines") and not n.startswith("_")]
    assert {"inspect_lines", "scan_lines", "diff_lines", "convert_lines"} <= set(views)
    for name in views:
        assert getattr(render, name).__wrapped__, name


# inspect


def test_inspect_text_escapes_keys_once(run, files):
    out, err = checked(run("inspect", "keys.pt"))
    assert err == ""
    assert "  \\x1b[2K\\x0dsafe\\x07.weight  [2] f32  8 B" in out.splitlines()
    assert "  nul\\x00cr\\x0d.bias  [2] f32  8 B" in out.splitlines()
    assert "  bad\\xff\\ud800.weight  [2] f32  8 B" in out.splitlines()
    assert "  é中文.weight  [2] f32  8 B" in out.splitlines()  # printable: untouched
    assert "  back\\\\slash.weight  [2] f32  8 B" in out.splitlines()  # escaped once, not twice
    flat, _ = checked(run("inspect", "keys.pt", "--flat"))
    assert {unescape(line.split("  ")[0]) for line in flat.splitlines()[-5:]} == set(KEYS)


def test_inspect_json_round_trips_keys(run, files):
    doc = loaded(run("inspect", "keys.pt", "--json"))
    keys = [t["key"] for t in doc["tensors"]]
    # Valid text comes back exactly (JSON escapes the controls); invalid UTF-8 escaped.
    assert keys == [ESC_KEY, NUL_KEY, escape(BAD_KEY), UNI_KEY, BS_KEY]
    assert unescape(keys[2]) == BAD_KEY


def test_inspect_extras_and_metadata(run, files):
    out, _ = checked(run("inspect", "train.pt"))
    lines = out.splitlines()
    assert "also        note\\x1b[31m = value\\x1b[2K\\x0d\\x0asafe      nothing" in lines
    assert "also        bad\\xff = 1" in lines
    assert not any(line.startswith("safe      nothing") for line in lines)  # no line injected
    doc = loaded(run("inspect", "train.pt", "--json"))
    assert doc["extras"]["note\x1b[31m"] == "value\x1b[2K\r\nsafe      nothing"
    assert doc["extras"]["bad\\xff"] == 1

    out, _ = checked(run("inspect", "m.safetensors"))
    assert "metadata    k\\x1b[2K = v\\x0d\\x07é" in out.splitlines()
    assert "metadata    lang = 中文" in out.splitlines()
    doc = loaded(run("inspect", "m.safetensors", "--json"))
    assert doc["metadata"] == {"k\x1b[2K": "v\r\x07é", "lang": "中文"}


def test_inspect_errors_quoting_keys(run, files):
    _, err = checked(run("inspect", "keys.pt", "--select", "x\x1b[2K"), code=1)
    assert err.startswith("Error: no 'x\\x1b[2K' in the checkpoint; available here: ")
    assert "enc.bad\\xff\\ud800.weight" in err and err.count("\n") == 1
    result = run("inspect", "train.pt", "--select", "bad\udcff", "--json")
    doc = loaded(result)
    assert doc["error"]["message"].startswith("'bad\\xff' in train.pt is not a state dict")
    assert clean(result.stderr_bytes).startswith("Error: 'bad\\xff' in train.pt")


def test_error_line_quoting_a_path(run, files):
    _, err = checked(run("inspect", "nope\x1b\r.pt"), code=1)
    assert err == "Error: nope\\x1b\\x0d.pt does not exist; check the path\n"


# scan


def test_scan_dangerous_line_cannot_be_rewritten(run, files):
    out, err = checked(run("scan", "evil.pkl"), code=1)
    assert err == ""
    assert out.splitlines() == [
        "evil.pkl: dangerous (pickle)",
        "  dangerous builtins.exec",
        "  unknown   builtins.exec\\x1b[1A\\x1b[2K\\x0d  safe      all good",
        "  unknown   x\\xff.y",
    ]
    doc = loaded(run("scan", "evil.pkl", "--json"))
    assert doc["verdict"] == "dangerous"
    assert doc["files"][0]["globals"] == {
        "builtins.exec": "dangerous",
        f"builtins.{EVIL}": "unknown",  # valid text: JSON's own escapes, exact
        "x\\xff.y": "unknown",  # not UTF-8: escaped
    }


def test_scan_member_names(run, files):
    out, _ = checked(run("scan", "member.pt"), code=1)
    assert out.splitlines()[:2] == ["member.pt: dangerous (torch-zip)", "  dangerous builtins.exec"]
    assert "archive/\\x1b[2K\\x0dx.pkl" in out
    doc = loaded(run("scan", "member.pt", "--json"))
    assert doc["files"][0]["pickles"][-1]["pickle"] == "archive/\x1b[2K\rx.pkl"


@pytest.mark.parametrize("command", [("scan",), ("inspect",), ("scan", "--json")])
def test_bit_flipped_member_name(run, files, command):
    out, err = checked(run(*command, "flipped.pt"), code=None)
    assert "\x0e" not in out + err
    if command == ("scan",):
        assert out.splitlines()[1] == "  dangerous builtins.exec"
        assert "archive/extra\\x0epkl" in out


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_corpus_output_is_clean(run, tmp_path, name):
    """The tar/pickle polyglot, the legacy tar polyglot and the rest printed raw bytes or
    controls taken from the file; every command's output is clean UTF-8 now."""
    (tmp_path / "f.pt").write_bytes(CASES[name][0]())
    for command in ("scan", "inspect"):
        checked(run(command, "f.pt"), code=None)
        loaded(run(command, "f.pt", "--json"))


def test_damaged_zip_name(run, tmp_path):
    """The damaged corpus's zip whose member name is not UTF-8 though its flag says it is."""
    from damaged import FIXTURES, _zip_fields

    data = _zip_fields((FIXTURES / "single.pt").read_bytes())["zip_non_utf8_name"]
    (tmp_path / "z.pt").write_bytes(data)
    for command in ("scan", "inspect", "diff"):
        args = (command, "z.pt") + (("z.pt",) if command == "diff" else ())
        checked(run(*args), code=None)
        loaded(run(*args, "--json"))


# diff and convert


def test_diff(run, files):
    out, err = checked(run("diff", "keys.pt", "keys2.pt"), code=1)
    lines = out.splitlines()
    assert "only in A    2: enc.bad\\xff\\ud800.weight, enc.back\\\\slash.weight" in lines
    assert "only in B    1: only.\\x1bB" in lines
    assert "mismatch     enc.\\x1b[2K\\x0dsafe\\x07.weight: [2] float32 vs [3] float32" in lines
    assert "mismatch     enc.é中文.weight: [2] float32 vs [3] float32" in lines
    assert lines[-1] == "differ"
    doc = loaded(run("diff", "keys.pt", "keys2.pt", "--json"))
    assert escape(BAD_KEY) in doc["only_a"] and "only.\x1bB" in doc["only_b"]


def test_convert_report(run, files):
    # (.pt: a safetensors header refuses the key that is not UTF-8, see the test below)
    out, _ = checked(run("convert", "keys.pt", "out.pt", "--dry-run"))
    assert "  enc.\\x1b[2K\\x0dsafe\\x07.weight -> enc.\\x1b[2K\\x0dsafe\\x07.weight" in out
    assert "  enc.bad\\xff\\ud800.weight -> enc.bad\\xff\\ud800.weight" in out
    doc = loaded(run("convert", "keys.pt", "out.pt", "--dry-run", "--json"))
    assert {"from": escape(BAD_KEY), "to": escape(BAD_KEY)} in doc["keys"]
    assert {"from": ESC_KEY, "to": ESC_KEY} in doc["keys"]
    # A real conversion of keys that are text with controls, stripped of their prefix.
    out, _ = checked(run("convert", "m.safetensors", "out.pt", "--strip-prefix", "enc."))
    assert "Keys     3 tensors, 24 B: strip 'enc.'" in out
    assert "Wrote    out.pt (torch), verified bit-exact" in out.splitlines()
    written = torch.load(files / "out.pt", weights_only=True)
    assert set(written) == {k.removeprefix("enc.") for k in (ESC_KEY, NUL_KEY, UNI_KEY)}
    out, _ = checked(run("convert", "train.pt", "t.pt"))
    assert "Omitted  bad\\xff, note\\x1b[31m: not written" in out


def test_convert_error_quoting_keys(run, files):
    _, err = checked(run("convert", "keys.pt", "o.pt", "--rename", r"enc\..*=same"), code=1)
    assert err.startswith("Error: renaming maps two keys onto one: 'enc.\\x1b[2K\\x0dsafe")
    assert err.count("\n") == 1
    doc = loaded(run("convert", "keys.pt", "o.pt", "--rename", r"enc\..*=same", "--json"))
    assert doc["error"]["type"] == "KeyTransformError"
    # The message quotes a key that is not UTF-8: the whole string is escaped, as in text.
    assert escape(ESC_KEY) in doc["error"]["message"]
    assert BAD_KEY in unescape(doc["error"]["message"])


def test_header_keys_that_are_not_utf8(run, tmp_path):
    """A safetensors header naming a key with JSON's \\udcff escape (valid JSON, no text)."""
    header = json.dumps({"w\udcff\x1b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})
    raw = header.encode()
    (tmp_path / "h.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    out, _ = checked(run("inspect", "h.safetensors"))
    assert "w\\xff\\x1b  [1] f32  4 B" in out.splitlines()
    doc = loaded(run("inspect", "h.safetensors", "--json"))
    assert doc["tensors"][0]["key"] == "w\\xff\\x1b"  # the whole string escaped, as in text


def test_a_key_that_is_not_utf8_is_refused_for_safetensors(tmp_path, run):
    """safetensors' JSON header holds UTF-8 text only: such a key is named, nothing written;
    a .pt output keeps it."""
    torch.save({"a\udcffb": torch.ones(2)}, tmp_path / "k.pt")
    result = run("convert", tmp_path / "k.pt", "out.safetensors")
    assert result.exit_code == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error: key 'a\\xffb'") and "not valid UTF-8" in line
    assert not (tmp_path / "out.safetensors").exists()
    assert run("convert", tmp_path / "k.pt", "out.pt").exit_code == 0
    assert list(torch.load(tmp_path / "out.pt")) == ["a\udcffb"]
