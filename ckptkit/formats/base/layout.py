"""A tensor described by where its bytes lie: the byte ranges of some inputs (numbered slots:
a group's source tensors, a reader's rank files) that, end to end, are its row-major bytes, and
runs of zeros. The rearrangements that move elements whole (joining and cutting along any dim,
permuting rows, padding) are done on layouts, so that a tensor made by them is written by
copying ranges of the files it comes from, without torch.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence

__all__ = [
    "Layout",
    "Piece",
    "ZEROS",
    "concat",
    "split",
    "narrow",
    "pad",
    "rope",
    "stack",
    "unstack",
    "from_boxes",
    "MOST_RUNS",
]

ZEROS = -1  # a piece's slot for a run of zero bytes (pad)
Piece = tuple[int, int, int]  # (input slot, or ZEROS; byte offset in that input; byte count)


class Layout:
    """One tensor as byte ranges of the group's inputs (each input numbered by its slot)."""

    __slots__ = ("shape", "itemsize", "pieces", "_ends")

    def __init__(self, shape: Sequence[int], itemsize: int, pieces: Iterable[Piece]) -> None:
        self.shape = tuple(shape)
        self.itemsize = itemsize
        self.pieces = _joined(pieces)
        self._ends: list[int] | None = None

    @classmethod
    def of_input(cls, slot: int, shape: Sequence[int], itemsize: int) -> Layout:
        """Input ``slot``'s tensor, whole and contiguous."""
        return cls(shape, itemsize, [(slot, 0, math.prod(shape) * itemsize)])

    def moved(self, by: int) -> Layout:
        """The same layout with its slots numbered ``by`` higher (inputs laid side by side)."""
        if by == 0:
            return self
        pieces = [(s if s == ZEROS else s + by, o, n) for s, o, n in self.pieces]
        return Layout(self.shape, self.itemsize, pieces)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def take(self, start: int, count: int) -> list[Piece]:
        """The pieces of bytes ``start`` to ``start + count`` of this tensor."""
        if count <= 0:
            return []
        if len(self.pieces) == 1:  # a whole input (most are): no search
            slot, offset, _ = self.pieces[0]
            return [(slot, offset + (start if slot != ZEROS else 0), count)]
        if self._ends is None:
            ends, total = [], 0
            for _, _, length in self.pieces:
                total += length
                ends.append(total)
            self._ends = ends
        ends = self._ends
        out: list[Piece] = []
        i = bisect.bisect_right(ends, start)
        end = start + count
        while start < end:
            slot, offset, length = self.pieces[i]
            begin = ends[i] - length  # where piece i starts in this tensor
            skip = start - begin
            n = min(length - skip, end - start)
            out.append((slot, offset + (skip if slot != ZEROS else 0), n))
            start += n
            i += 1
        return out

    def _row(self, dim: int) -> tuple[int, int]:
        """(the count of slices before ``dim``, bytes per unit of ``dim``)."""
        return math.prod(self.shape[:dim]), math.prod(self.shape[dim + 1 :]) * self.itemsize


def _joined(pieces: Iterable[Piece]) -> list[Piece]:
    """Pieces with neighbours that continue each other merged (fewer, longer copies)."""
    out: list[Piece] = []
    for piece in pieces:
        if piece[2] == 0:
            continue
        if out:
            slot, offset, length = out[-1]
            if slot == piece[0] and (slot == ZEROS or offset + length == piece[1]):
                out[-1] = (slot, offset, length + piece[2])
                continue
        out.append(piece)
    return out


def concat(values: list[Layout], dim: int, groups: int) -> Layout:
    """``torch.cat`` along ``dim`` (with ``groups``: each value's groups placed in turn)."""
    first = values[0]
    dim %= len(first.shape)
    outer = first._row(dim)[0] * groups
    chunks = [(t, t.shape[dim] // groups * t._row(dim)[1]) for t in values]
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in values)
    if outer == 1:
        return Layout(shape, first.itemsize, [p for t in values for p in t.pieces])
    pieces: list[Piece] = []
    for o in range(outer):
        for t, chunk in chunks:
            pieces += t.take(o * chunk, chunk)
    return Layout(shape, first.itemsize, pieces)


def split(t: Layout, dim: int, sizes: Sequence[int], groups: int) -> list[Layout]:
    """:func:`concat` undone: one layout per size (each joining its piece of every group)."""
    outer, unit = t._row(dim)
    outer *= groups
    row = sum(sizes) * unit  # one group's bytes of one slice before dim
    out, at = [], 0
    for size in sizes:
        shape = list(t.shape)
        shape[dim] = size * groups
        pieces: list[Piece] = []
        for o in range(outer):
            pieces += t.take(o * row + at, size * unit)
        out.append(Layout(shape, t.itemsize, pieces))
        at += size * unit
    return out


def narrow(t: Layout, dim: int, start: int, size: int, groups: int = 1) -> Layout:
    """``torch.narrow`` along ``dim`` (with ``groups``: the same part of each group, joined):
    one of :func:`split`'s layouts, without making the others."""
    outer, unit = t._row(dim)
    outer *= groups
    row = t.shape[dim] // groups * unit  # one group's bytes of one slice before dim
    pieces: list[Piece] = []
    for o in range(outer):
        pieces += t.take(o * row + start * unit, size * unit)
    shape = list(t.shape)
    shape[dim] = size * groups
    return Layout(shape, t.itemsize, pieces)


def stack(values: list[Layout]) -> Layout:
    """``torch.stack``: the values end to end on a new first dim."""
    first = values[0]
    pieces = [p for t in values for p in t.pieces]
    return Layout((len(values), *first.shape), first.itemsize, pieces)


def unstack(t: Layout) -> list[Layout]:
    """``torch.unbind(0)``: one layout per index of the first dim."""
    rows = split(t, 0, [1] * t.shape[0], 1)
    return [Layout(t.shape[1:], t.itemsize, row.pieces) for row in rows]


def pad(t: Layout, dim: int, full: int) -> Layout:
    """Zeros after each slice's ``dim`` up to ``full``."""
    outer, unit = t._row(dim)
    have = t.shape[dim] * unit
    pieces: list[Piece] = []
    for o in range(outer):
        pieces += t.take(o * have, have)
        pieces.append((ZEROS, 0, (full - t.shape[dim]) * unit))
    shape = list(t.shape)
    shape[dim] = full
    return Layout(shape, t.itemsize, pieces)


def rope(t: Layout, heads: int, *, forward: bool) -> Layout:
    """The rows of ``mapping.ops._rope``'s permutation: each head's rows from interleaved pairs to
    halves (``forward``) or back."""
    rows = t.shape[0]
    unit = t._row(0)[1]
    per_head = rows // heads
    half = per_head // 2
    pieces: list[Piece] = []
    for h in range(heads):
        base = h * per_head
        for j in range(per_head):
            # forward: output row (h, j) is input row (h, 2i + k) with j = k * half + i
            k, i = divmod(j, half) if forward else (j % 2, j // 2)
            row = base + (2 * i + k if forward else k * half + i)
            pieces += t.take(row * unit, unit)
    return Layout(t.shape, t.itemsize, pieces)


# Past this many runs a tensor's boxes are pieced together through torch instead (a chunking
# that cuts the last dims finely would make a piece of every few elements).
MOST_RUNS = 1 << 16


def from_boxes(
    shape: Sequence[int], itemsize: int, boxes: Sequence[tuple[Sequence[int], Sequence[int]]]
) -> Layout | None:
    """A tensor whose parts are boxes of it (a sharded save's chunks: offsets and sizes per
    dim, each box's elements row-major in its slot, slot i for box i) that tile it exactly
    (``chunks.check_cover`` says so first); None past :data:`MOST_RUNS` pieces."""
    if not shape:
        return Layout(shape, itemsize, [(0, 0, itemsize)])
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    runs: list[tuple[int, int, int, int]] = []  # (where in the tensor, slot, where in it, count)
    for slot, (offsets, sizes) in enumerate(boxes):
        if math.prod(sizes) == 0:
            continue
        # The dims after k span the tensor whole: each index of the dims before k is one run.
        k = len(shape) - 1
        while k > 0 and sizes[k] == shape[k]:
            k -= 1
        count, length = math.prod(sizes[:k]), sizes[k] * strides[k]
        if len(runs) + count > MOST_RUNS:
            return None
        base = sum(o * s for o, s in zip(offsets, strides, strict=True))
        for n, index in enumerate(itertools.product(*(range(m) for m in sizes[:k]))):
            at = base + sum(i * s for i, s in zip(index, strides, strict=False))
            runs.append((at, slot, n * length, length))
    runs.sort()
    return Layout(shape, itemsize, [(slot, at * itemsize, n * itemsize) for _, slot, at, n in runs])
