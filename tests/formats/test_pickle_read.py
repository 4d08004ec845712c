"""The static pickle reader against CPython's own unpickler: whatever plain data
``pickle.dumps`` writes, at every protocol, ckptkit reads back as ``pickle.loads`` does (bit for
bit: a NaN keeps its payload, -0.0 its sign, True stays a bool and a tuple a tuple), and as the
object that was pickled."""

from __future__ import annotations

import math
import pickle

import pytest
from helpers import same_tree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptkit.formats.pickles.unpickler import read_pickle

PROTOCOLS = range(pickle.HIGHEST_PROTOCOL + 1)

# Every string, lone surrogates included (pickle keeps them; UTF-8 alone cannot).
TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
INTS = (
    st.integers()
    | st.integers(-(2**300), 2**300)
    | st.sampled_from([2**31, -(2**31) - 1, 2**63, -(2**64), 255])
)
# What a set, a frozenset or a dict key may hold: hashable, and equal to itself (no NaN).
HASHABLE = st.recursive(
    st.none() | st.booleans() | INTS | st.floats(allow_nan=False) | TEXT | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4).map(tuple) | st.frozensets(inner, max_size=4),
    max_leaves=8,
)
VALUES = st.recursive(
    st.none() | st.booleans() | INTS | st.floats() | TEXT | st.binary(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.lists(inner, max_size=5).map(tuple)
        | st.dictionaries(HASHABLE, inner, max_size=5)
        | st.sets(HASHABLE, max_size=5)
        | st.frozensets(HASHABLE, max_size=5)
    ),
    max_leaves=25,
)


def _without_nan_bits(value):
    """``value`` with every NaN made the one NaN ``float('nan')``: protocol 0 writes floats as
    text, which keeps a NaN but not its sign or payload."""
    if isinstance(value, float):
        return float("nan") if math.isnan(value) else value
    if isinstance(value, list | tuple):
        return type(value)(_without_nan_bits(v) for v in value)
    if isinstance(value, dict):
        return {k: _without_nan_bits(v) for k, v in value.items()}
    return value


def _read(data: bytes, file_mode: bool):
    scan = read_pickle(data, file_mode=file_mode)
    assert scan.run.damaged is None and not scan.run.problems, (scan.run.damaged, scan.run.problems)
    assert scan.run.end == len(data)
    return scan.root


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=VALUES, protocol=st.sampled_from(PROTOCOLS), file_mode=st.booleans())
def test_plain_data_reads_back_as_pickle_loads_reads_it(obj, protocol, file_mode):
    data = pickle.dumps(obj, protocol=protocol)
    root = _read(data, file_mode)
    assert same_tree(root, pickle.loads(data))  # the reference: CPython's unpickler
    if protocol == 0:
        assert same_tree(_without_nan_bits(root), _without_nan_bits(obj))
    else:
        assert same_tree(root, obj)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_shared_and_edge_values_at_every_protocol(protocol):
    shared = [1, "x"]
    obj = {
        "shared": [shared, shared],
        "floats": [float("nan"), -0.0, 0.0, float("inf"), -float("inf"), 5e-324, 1e308],
        "ints": [0, -1, 255, 256, 65535, 2**31 - 1, -(2**31), 2**63, -(2**1000), True, False],
        "text": ["", "\x00\n\r\\", "\u2028é✓", "\ud800"],
        "bytes": [b"\x00\xff", b"x" * 300],
        "sets": [set(), frozenset(), {1, "a", (2, b"b")}, frozenset({frozenset({None})})],
        (1, (2, None)): {(): []},
    }
    data = pickle.dumps(obj, protocol=protocol)
    root = _read(data, file_mode=True)
    assert same_tree(root, pickle.loads(data))
    assert root["shared"][0] is root["shared"][1]  # one object, as the memo says
    if protocol:  # binary floats keep every bit
        assert same_tree(root, obj)


@pytest.mark.parametrize("protocol", [0, 1, 2])
def test_empty_bytes_below_protocol_3(protocol):
    # b'' pickles as builtins.bytes() below protocol 3: decoded as data, never called.
    data = pickle.dumps({"empty": b""}, protocol=protocol)
    assert same_tree(_read(data, file_mode=True), {"empty": b""})
