"""Checkpoint metadata: safetensors header (str -> str) and JSON, without loss."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from ckptkit.meta import CheckpointMeta, jsonable

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=10,
)


def test_header_is_str_to_str_with_format_pt_and_namespaced_fields():
    meta = CheckpointMeta(
        source="a.pt", removed_prefixes=["module."], extras={"epoch": 3}, other={"origin": "hub"}
    )
    header = meta.to_header()
    assert header["format"] == "pt"
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in header.items())
    assert json.loads(header["ckptkit.extras"]) == {"epoch": 3}
    assert header["origin"] == "hub"
    assert "ckptkit.aliases" not in header  # empty fields stay out


@given(
    extras=st.dictionaries(st.text(max_size=6), json_values, max_size=4),
    aliases=st.dictionaries(
        st.text(min_size=1, max_size=6), st.text(min_size=1, max_size=6), max_size=3
    ),
)
def test_header_round_trip(extras, aliases):
    meta = CheckpointMeta(source="x", extras=extras, aliases=aliases, other={"k": "v"})
    assert CheckpointMeta.from_header(meta.to_header()) == meta


def test_foreign_and_broken_keys_are_kept_as_text():
    meta = CheckpointMeta.from_header({"format": "pt", "ckptkit.extras": "{not json", "x": "1"})
    assert meta.extras == {}
    assert meta.other == {"ckptkit.extras": "{not json", "x": "1"}
    assert meta.is_empty()


def test_jsonable_handles_what_checkpoints_hold():
    value = {"t": (1, 2), "s": {3}, "b": b"abc", "nan": float("nan"), 4: None}
    assert jsonable(value) == {"t": [1, 2], "s": [3], "b": {"bytes": 3}, "nan": "nan", "4": None}
    json.dumps(jsonable(value), allow_nan=False)
