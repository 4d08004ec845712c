"""The pickle writer: what it writes, ``pickle`` reads back as the same values; names are written
without importing their modules; ckptkit's .pt and DCP writers no longer import torch."""

from __future__ import annotations

import argparse
import io
import pickle
import pickletools
from collections import OrderedDict

import pytest
from helpers import FIXTURE_DIR, no_torch_imported
from hypothesis import given
from hypothesis import strategies as st

from ckptkit.formats.pickles.writer import Call, New, PersistentId, Ref, dumps

plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=6).map(tuple)
        | st.dictionaries(st.text(max_size=5) | st.integers(), inner, max_size=4)
        | st.dictionaries(st.text(max_size=5), inner, max_size=4).map(OrderedDict)
    ),
    max_leaves=20,
)


def _typed(value):
    """The value with every container's type kept, to compare types as well as values."""
    if isinstance(value, (list, tuple)):
        return type(value).__name__, [_typed(v) for v in value]
    if isinstance(value, dict):
        return type(value).__name__, [(_typed(k), _typed(v)) for k, v in value.items()]
    return type(value).__name__, value


@given(plain)
def test_plain_values_read_back_the_same(value):
    data = dumps(value)
    assert _typed(pickle.loads(data)) == _typed(value)
    pickletools.dis(data, out=io.StringIO())  # well-formed, opcode by opcode


def test_globals_calls_objects_and_persistent_ids():
    ns = New(Ref("argparse", "Namespace"), {"lr": 0.1, "name": "x"})
    value = {
        "ordered": Call(Ref("collections", "OrderedDict")),
        "ns": ns,
        "again": Ref("collections", "OrderedDict"),  # memoized: read from the memo
        "storage": PersistentId(("storage", 7)),
        Call(Ref("builtins", "frozenset"), ([1, 2],)): "objects as keys",  # hashed by identity
    }
    seen = []

    class Loader(pickle.Unpickler):
        def persistent_load(self, pid):
            seen.append(pid)
            return "loaded"

    out = Loader(io.BytesIO(dumps(value))).load()
    assert out["ordered"] == OrderedDict() and type(out["ordered"]) is OrderedDict
    assert out["ns"] == argparse.Namespace(lr=0.1, name="x")
    assert out["again"] is OrderedDict
    assert out["storage"] == "loaded" and seen == [("storage", 7)]
    assert out[frozenset({1, 2})] == "objects as keys"
    assert dumps(Ref("x", "y")).count(b"cx\ny\n") == 1


def test_many_globals_use_long_memo_indexes():
    refs = [Ref("collections", name) for name in ("OrderedDict", "Counter", "deque")] * 2
    refs += [Ref("argparse", "Namespace")] * 300  # one name, memo index < 256
    many = [Call(Ref("fractions", "Fraction"), (i, 1)) for i in range(3)]
    assert pickle.loads(dumps(refs + many))[-1] == 2
    names = [Ref("string", n) for n in ("ascii_letters", "digits")]
    assert (
        pickle.loads(dumps(names * 2))[2] == "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    )


def test_unknown_values_are_refused():
    with pytest.raises(TypeError, match="cannot pickle set"):
        dumps({1, 2})


@pytest.mark.parametrize("to", ["pt", "dcp"])
def test_writing_pt_and_dcp_does_not_import_torch(tmp_path, to):
    no_torch_imported(
        "from ckptkit.convert import convert\n"
        f"assert convert({str(FIXTURE_DIR / 'tied.pt')!r}, {str(tmp_path / 'out')!r}, to={to!r}).verified"
    )
    import torch

    if to == "pt":
        state = torch.load(tmp_path / "out", weights_only=True)
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(tmp_path / "out", tmp_path / "back.pt")
        state = torch.load(tmp_path / "back.pt", weights_only=True)
    original = torch.load(FIXTURE_DIR / "tied.pt", weights_only=True)
    assert state.keys() == original.keys()
    assert all(torch.equal(state[k], original[k]) for k in state)
