"""The mapping file's small languages on their own: expressions (read, never eval'd), anchored
key patterns that write back what they read, and the file's format with its refusals."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptkit.errors import MappingError
from ckptkit.mapping.expr import parse_call, parse_expr
from ckptkit.mapping.patterns import parse_pattern
from ckptkit.mapping.spec import load_mapping, packs, parse_mapping

# --- expressions -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "names", "value"),
    [
        ("dim // n_heads", {"dim": 4096, "n_heads": 32}, 128),
        ("i + offset * 2 - 1", {"i": 3, "offset": 5}, 12),
        ("0 if a == b else 1", {"a": 2, "b": 2}, 0),
        ("max(1, n // 8) % 7", {"n": 80}, 3),
        ("-x", {"x": 4}, -4),
        ("[q, kv, kv]", {"q": 8, "kv": 2}, [8, 2, 2]),
        ("not a and b or c", {"a": False, "b": True, "c": False}, True),
        ("1 < x <= 3", {"x": 3}, True),
        (7, {}, 7),
    ],
)
def test_expressions_compute_integers(text, names, value):
    assert parse_expr(text, "here").evaluate(names) == value


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",
        "x.__class__",
        "x[0]",
        "lambda: 1",
        "open('f')",
        "[i for i in x]",
        "f'{x}'",
        "x ** 2",
        "min(x, key=y)",
        "b'bytes'",
        "1 +",
        "x" * 401,
    ],
)
def test_expressions_refuse_anything_but_the_language(text):
    with pytest.raises(MappingError):
        parse_expr(text, "rule 3")


def test_an_unknown_name_says_how_to_set_it():
    with pytest.raises(MappingError, match="reads 'tp', which is not set.*--set tp=VALUE"):
        parse_expr("tp * 2", "x").evaluate({"dim": 1})


def test_division_by_zero_and_huge_values_are_refused():
    with pytest.raises(MappingError, match="divides by zero"):
        parse_expr("a // b", "x").evaluate({"a": 1, "b": 0})
    with pytest.raises(MappingError, match="beyond any tensor"):
        parse_expr("a * a * a", "x").evaluate({"a": 10**9})


def test_ops_are_calls_with_expressions():
    name, args, kwargs = parse_call("split(0, sizes=[q, kv, kv], groups=g)", "rule 1")
    assert name == "split" and [a.text for a in args] == ["0"]
    assert {k: v.text for k, v in kwargs.items()} == {"sizes": "[q, kv, kv]", "groups": "g"}
    assert parse_call("same", "r")[0] == "same"
    for bad in ("x.y()", "split(**d)", "1 + 2", "split(0"):
        with pytest.raises(MappingError):
            parse_call(bad, "r")


# --- patterns ----------------------------------------------------------------------------------


def test_patterns_are_anchored_and_canonical():
    pattern = parse_pattern("layers.{i}.attention.wq.weight", "r")
    assert pattern.match("layers.12.attention.wq.weight", {}) == {"i": 12}
    for other in (
        "model.layers.1.attention.wq.weight",  # a longer key, not a search
        "layers.1.attention.wq.weight.bias",
        "layers.01.attention.wq.weight",  # would come back as layers.1: not this pattern's
        "layers.x.attention.wq.weight",
        "layers.1.attention.wqXweight",  # the dots are literal
    ):
        assert pattern.match(other, {}) is None, other


def test_a_shift_is_undone_when_read_back():
    pattern = parse_pattern("model.layers.{i + offset}.mlp", "r")
    assert pattern.format({"i": 2}, {"offset": 10}) == "model.layers.12.mlp"
    assert pattern.match("model.layers.12.mlp", {"offset": 10}) == {"i": 2}
    assert pattern.match("model.layers.9.mlp", {"offset": 10}) is None  # i would be negative
    minus = parse_pattern("h.{i - 1}", "r")
    assert minus.format({"i": 1}, {}) == "h.0" and minus.match("h.0", {}) == {"i": 1}


@given(st.integers(0, 10**6), st.integers(-1000, 1000), st.integers(0, 3))
def test_patterns_read_back_what_they_write(i, offset, width):
    spec = f":0{width}" if width else ""
    pattern = parse_pattern(f"a.{{i + offset{spec}}}.b.{{name:str}}", "r")
    captures = {"i": i, "name": "wq"}
    names = {"offset": offset}
    if i + offset < 0:
        return
    key = pattern.format(captures, names)
    assert pattern.match(key, names) == captures


@pytest.mark.parametrize(
    "text", ["a.{i", "a.}i", "a.{i}{j}", "a.{i * 2}", "a.{1}", "a.{i + i}", "a.{i:03x}", ""]
)
def test_bad_patterns_are_refused(text):
    with pytest.raises(MappingError):
        parse_pattern(text, "rule 2")


# --- the file ----------------------------------------------------------------------------------

BASE = {
    "from": "a",
    "to": "b",
    "rules": [{"from": "x.{i}.w", "to": "y.{i}.w"}],
}


def refused(document, *needles):
    with pytest.raises(MappingError) as caught:
        parse_mapping(document, "m.toml")
    for needle in needles:
        assert needle in str(caught.value), str(caught.value)


def test_the_file_format_refuses_what_it_does_not_know():
    parse_mapping(BASE, "m.toml")  # the base itself is fine
    refused({**BASE, "rulez": []}, "unknown field(s) rulez")
    refused({**BASE, "to": "a"}, "two sides")
    refused({**BASE, "rules": []}, "no [[rules]]")
    refused({**BASE, "rules": [{"from": "x.{i}", "to": "y.{j}"}]}, "writes {j}")
    refused({**BASE, "rules": [{"from": "x", "ops": ["explode()"]}]}, "unknown op 'explode'")
    refused({**BASE, "rules": [{"from": "x", "to": "y", "ops": ["gather()"]}]}, "needs dim")
    refused({**BASE, "rules": [{"from": "x", "to": "y", "ops": ["gather(1, 2)"]}]}, "at most 1")
    refused({**BASE, "rules": [{"from": "x", "to": "y", "ops": ["drop('no')"]}]}, "no 'to'")
    refused({**BASE, "rules": [{"from": "x"}]}, "has no 'to'")
    refused({**BASE, "rules": [{"to": "x"}]}, "has no 'from'")
    refused({**BASE, "sides": {"c": {}}}, "neither 'from' nor 'to'")
    refused({**BASE, "sides": {"a": {"files": "r{rank}.pt"}}}, "go together")
    refused({**BASE, "sides": {"a": {"files": "r{i}.pt", "ranks": "tp"}}}, "by its number alone")
    refused({**BASE, "sides": {"a": {"files": "../x{rank}.pt", "ranks": "tp"}}}, "by its number")
    refused({**BASE, "sides": {"a": {"file": ".."}}}, "names one file in the folder")
    refused({**BASE, "sides": {"a": {"config": "../../etc/x.json"}}}, "names a file in")
    refused({**BASE, "sides": {"b": {"write": {"file": "../victim.txt"}}}}, "names its 'file'")
    refused(
        {**BASE, "rules": [{"from": "x.{a:str}-{b:str}", "to": "y.{a}.{b}"}]}, "whole dotted part"
    )
    refused({**BASE, "rules": [{"from": "x", "to": "y", "optional": "false"}]}, "true or false")


def test_reversing_needs_what_each_inverse_needs():
    doc = {**BASE, "rules": [{"from": "x", "to": "y", "ops": ["cast('bfloat16')"]}]}
    with pytest.raises(MappingError, match="which dtype to cast back to"):
        parse_mapping(doc, "m.toml").reversed()
    doc = {**BASE, "rules": [{"from": "x", "to": "y", "ops": ["slice(0, size=v)"]}]}
    with pytest.raises(MappingError, match="to what size would pad fill"):
        parse_mapping(doc, "m.toml").reversed()


def test_reversed_rules_undo_their_ops_in_reverse_order_and_drops_make_nothing():
    doc = {
        **BASE,
        "rules": [
            {"from": "x.{i}", "to": "y.{i}", "ops": ["gather(dim=0)", "permute_rope(heads=h)"]},
            {"from": "junk", "ops": ["drop(reason='not weights')"]},
        ],
    }
    mapping = parse_mapping(doc, "m.toml")
    back = mapping.reversed()
    assert back.direction == "b -> a" and len(back.rules) == 1
    (rule,) = back.rules
    assert [op.name for op in rule.ops] == ["unpermute_rope", "scatter"]
    assert [p.source for p in rule.sources] == ["y.{i}"]
    assert back.reversed().rules[0].ops[0].name == "gather"


def test_packs_are_named_and_a_missing_one_is_refused(tmp_path):
    assert "llama-meta" in packs()
    assert load_mapping("llama-meta").direction == "meta -> hf"
    with pytest.raises(MappingError, match="neither a pack nor a file"):
        load_mapping("llama-nope")
    bad = tmp_path / "bad.toml"
    bad.write_text("rules = [")
    with pytest.raises(MappingError, match="not a TOML mapping file"):
        load_mapping(bad)
    huge = tmp_path / "huge.toml"
    huge.write_bytes(b"#" * (2 << 20))
    with pytest.raises(MappingError, match="larger than a mapping written by hand"):
        load_mapping(huge)
