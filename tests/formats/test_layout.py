"""Tensors laid out over the byte ranges they come from (ckptkit.formats.base.layout): a
sharded save's chunks of any shape tile their tensor as a layout whose bytes are the tensor's,
and a tensor written from such views is checked as it is written."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import FIXTURE_DIR
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.errors import VerificationError
from ckptkit.formats.base import layout as layouts
from ckptkit.formats.base.layout import from_boxes


@st.composite
def tilings(draw):
    """A shape and boxes that tile it: the whole tensor cut again and again along some dim."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    boxes = [((0,) * len(shape), shape)]
    for _ in range(draw(st.integers(0, 5))):
        i = draw(st.integers(0, len(boxes) - 1))
        offsets, sizes = boxes[i]
        dim = draw(st.integers(0, len(shape) - 1))
        if sizes[dim] < 2:
            continue
        cut = draw(st.integers(1, sizes[dim] - 1))
        first = (offsets, sizes[:dim] + (cut,) + sizes[dim + 1 :])
        second_offsets = offsets[:dim] + (offsets[dim] + cut,) + offsets[dim + 1 :]
        second = (second_offsets, sizes[:dim] + (sizes[dim] - cut,) + sizes[dim + 1 :])
        boxes[i : i + 1] = [first, second]
    order = draw(st.permutations(range(len(boxes))))
    return shape, [boxes[j] for j in order]


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@settings(max_examples=200, deadline=None)
@given(tilings())
def test_boxes_laid_out_are_the_tensors_bytes(tiling):
    """Every element comes from its box, once, in the tensor's order (any chunking: rows,
    columns, blocks, in any order in the file)."""
    shape, boxes = tiling
    t = torch.arange(math.prod(shape), dtype=torch.int32).reshape(shape)
    parts = [
        raw(t[tuple(map(slice, off, [o + n for o, n in zip(off, size, strict=True)]))])
        for off, size in boxes
    ]
    layout = from_boxes(shape, 4, boxes)
    assert layout is not None and layout.nbytes == len(raw(t))
    assert b"".join(parts[s][at : at + n] for s, at, n in layout.pieces) == raw(t)
    row_shards = all(size[1:] == shape[1:] for _, size in boxes)
    if row_shards:  # a box of whole rows is one run: as many pieces as boxes, or fewer
        assert len(layout.pieces) <= len(boxes)


def test_a_chunking_too_fine_is_left_to_torch(monkeypatch):
    monkeypatch.setattr(layouts, "MOST_RUNS", 3)
    assert from_boxes((4, 2), 4, [((0, 0), (4, 1)), ((0, 1), (4, 1))]) is None
    assert from_boxes((4, 2), 4, [((0, 0), (2, 2)), ((2, 0), (2, 2))]) is not None


def test_column_shards_are_written_from_views_and_checked(tmp_path, monkeypatch):
    """A DCP save of column shards converts without torch; a bit flipped on its way to the
    disk is caught by the CRC-32 of the bytes made, and nothing is left."""
    import ckptkit.formats.output.copier as copier

    columns = FIXTURE_DIR / "dcp" / "columns"
    report = ckptkit.convert(columns, tmp_path / "ok.safetensors")
    assert report.verified and report.through_torch == 0
    real = copier.write_all_of
    flipped = []

    def flipping(fd, views):
        if not flipped:
            data = bytearray(b"".join(views))
            data[-1] ^= 1
            views = [memoryview(data)]
            flipped.append(True)
        real(fd, views)

    monkeypatch.setattr(copier, "write_all_of", flipping)
    with pytest.raises(VerificationError):
        ckptkit.convert(columns, tmp_path / "bad.safetensors")
    assert flipped and not (tmp_path / "bad.safetensors").exists()


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    dim=st.integers(0, 2),
    groups=st.sampled_from([1, 2]),
    data=st.data(),
)
def test_narrow_is_torchs_narrow_and_one_of_splits(shape, dim, groups, data):
    """narrow(t, dim, start, size, groups) makes the bytes of torch.narrow on each group and
    equals split's layout of that part, on a layout already made of many pieces."""
    dim %= len(shape)
    shape[dim] *= groups
    x = torch.arange(math.prod(shape), dtype=torch.int16).reshape(shape)
    base = layouts.Layout.of_input(0, shape, 2)
    base = layouts.rope(base, 1, forward=True) if len(shape) > 1 and shape[0] % 2 == 0 else base
    raw = x.contiguous().view(torch.uint8).numpy().tobytes()
    laid = b"".join(raw[o : o + n] for _, o, n in base.pieces)
    tensor = torch.frombuffer(bytearray(laid), dtype=torch.int16).reshape(shape)
    per = shape[dim] // groups
    start = data.draw(st.integers(0, per - 1))
    size = data.draw(st.integers(1, per - start))
    made = layouts.narrow(base, dim, start, size, groups)
    want = torch.cat([g.narrow(dim, start, size) for g in tensor.chunk(groups, dim)], dim)
    assert (
        b"".join(raw[o : o + n] for _, o, n in made.pieces)
        == want.contiguous().view(torch.uint8).numpy().tobytes()
    )
    sizes = [start, size, per - start - size]
    parts = layouts.split(base, dim, [s for s in sizes if s], groups)
    assert made.pieces == parts[1 if start else 0].pieces
