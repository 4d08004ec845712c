"""Shard planning, output names and the index: pure functions, tested without tensors; and the
read-back errors that name what differs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptkit.errors import UsageError, VerificationError
from ckptkit.formats.base.dtypes import TensorSpec
from ckptkit.formats.output.copier import check_keys, check_layout, metadata_differ, ties_differ
from ckptkit.formats.output.plan import (
    index_document,
    parse_size,
    plan_shards,
    shard_paths,
    stale_shards,
)

tensors = st.lists(
    st.tuples(st.integers(0, 40), st.integers(1, 100)), max_size=30
).map(  # (storage id, nbytes): keys are unique, several may share a storage (a tied group)
    lambda rows: [(f"k{i}", n, f"s{s}") for i, (s, n) in enumerate(rows)]
)


@given(tensors, st.integers(1, 250))
def test_every_key_once_in_order_within_the_limit_and_ties_together(rows, limit):
    shards = plan_shards(rows, limit)
    flat = [key for shard in shards for key in shard]
    assert sorted(flat) == sorted(key for key, _, _ in rows)
    size = {key: n for key, n, _ in rows}
    storage = {key: s for key, _, s in rows}
    for shard in shards:
        total = sum(size[k] for k in shard)
        groups = {storage[k] for k in shard}
        # Over the limit only when one tied group alone is larger than it.
        assert total <= limit or len(groups) == 1, (shard, total)
    where = {key: i for i, shard in enumerate(shards) for key in shard}
    for key, _, s in rows:
        assert all(where[k] == where[key] for k, _, s2 in rows if s2 == s)
    # Groups appear in the order their first tensor does.
    firsts = list(dict.fromkeys(storage[k] for k in flat))
    assert firsts == list(dict.fromkeys(s for _, _, s in rows))


def test_no_limit_is_one_shard_and_a_large_tensor_gets_its_own():
    rows = [("a", 10, "a"), ("b", 500, "b"), ("c", 10, "c"), ("d", 10, "c")]
    assert plan_shards(rows, None) == [["a", "b", "c", "d"]]
    assert plan_shards(rows, 100) == [["a"], ["b"], ["c", "d"]]
    assert plan_shards([], 100) == [[]]


def test_shard_paths_and_the_index(tmp_path):
    dst = tmp_path / "model.safetensors"
    assert shard_paths(dst, 1) == [dst]
    paths = shard_paths(dst, 2)
    assert [p.name for p in paths] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    text = index_document(
        [[("a", 4), ("b", 8)], [("c", 2)]], [p.name for p in paths[:2]], {"x": "1"}
    )
    index = json.loads(text)
    assert index["metadata"] == {"total_size": 14, "x": "1"}
    assert index["weight_map"] == {
        "a": "model-00001-of-00002.safetensors",
        "b": "model-00001-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors",
    }


def test_stale_shards_are_the_earlier_runs_only():
    dst = Path("out/model.safetensors")
    present = [
        Path("out/model-00001-of-00003.safetensors"),
        Path("out/model-00002-of-00003.safetensors"),
        Path("out/model.safetensors.index.json"),
        Path("out/model.safetensors"),
        Path("out/other-00001-of-00002.safetensors"),
        Path("out/config.json"),
    ]
    written = [dst]
    assert stale_shards(dst, written, present) == present[:3]
    assert stale_shards(dst, present[:3], present) == []


@pytest.mark.parametrize(
    ("text", "value"), [("5GB", 5 * 10**9), ("2GiB", 2 * 2**30), (" 1.5 mb ", 1_500_000), (7, 7)]
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "5XB", "-1", "0", 0, "GB"])
def test_parse_size_refuses(text):
    with pytest.raises(UsageError):
        parse_size(text)


def test_read_back_errors_name_what_differs():
    shown = Path("out.safetensors")
    check_keys(shown, ["a", "b"], ["b", "a"])  # the same keys: no error
    with pytest.raises(VerificationError, match=r"\(missing 'b'; unexpected 'c'\)"):
        check_keys(shown, ["a", "b"], ["a", "c"])
    spec = TensorSpec("w", "float32", (2, 3))
    check_layout(shown, spec, "float32", [2, 3])
    with pytest.raises(
        VerificationError, match=r"'w' .*read back float16 \[3, 2\], planned float32 \[2, 3\]"
    ):
        check_layout(shown, spec, "float16", (3, 2))
    error = ties_differ(shown, {"lm_head.weight": "embed.weight"}, {})
    assert "'lm_head.weight': planned 'embed.weight', read None" in str(error)
    error = metadata_differ(shown, {"format": "pt", "a": "1"}, {"format": "pt", "a": "2"})
    assert "(in 'a')" in str(error)


def test_the_progress_bar_counts_the_output_once(tmp_path, monkeypatch):
    """With verify, each tensor counts half when written and half when checked: the bar ends
    at the output's size, not twice it."""
    import importlib

    from helpers import FIXTURE_DIR

    convert_module = importlib.import_module("ckptkit.convert")
    bars = []

    class Bar:
        def __init__(self, total, desc):
            self.total, self.n = total, 0.0
            bars.append(self)

        def update(self, n):
            self.n += n

        def close(self):
            pass

    monkeypatch.setattr(importlib.import_module("ckptkit.conversion.write"), "progress_bar", Bar)
    for verify in (True, False):
        report = convert_module.convert(
            FIXTURE_DIR / "ddp.pt", tmp_path / f"{verify}.safetensors", verify=verify, progress=True
        )
        assert bars[-1].total == report.nbytes
        assert bars[-1].n == pytest.approx(report.nbytes)
