"""Tensors stored as chunks (sharded saves): where each chunk lies, that the chunks cover their
tensor, and reading the full tensor from them.

A chunk is a box of the full tensor (offsets and sizes per dimension) whose bytes lie
contiguously somewhere in a file. A chunk that is one contiguous byte range of the full tensor
(a row shard: FSDP's, nearly always) is copied as it lies, without torch; chunks of any other
layout (column shards) are written from views of their ranges (``layout.from_boxes``), and
through torch only when they cut a tensor into very many pieces. Readers of sharded formats
(DCP folders, per-rank ``torch.save`` files) build :class:`ChunkedTensor` records and subclass
:class:`ChunkedSource`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import FormatError
from ckptkit.formats.base.dtypes import DTYPES
from ckptkit.formats.base.laid import Laid, Span, SpanViews
from ckptkit.formats.base.layout import from_boxes
from ckptkit.formats.base.source import Source, TensorInfo
from ckptkit.formats.base.tree import select_state_dict
from ckptkit.storage.location import Location
from ckptkit.storage.pieces import RangeReader

if TYPE_CHECKING:
    import torch

__all__ = ["Chunk", "ChunkedTensor", "ChunkedSource", "Piece", "check_cover", "contiguous_start"]

Piece = tuple[Location, int, int]  # (file, offset, length)


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: Location
    start: int  # where its record lies in the file (DCP: the chunk's torch.save archive)
    length: int


@dataclass
class ChunkedTensor:
    """A tensor of the checkpoint: its full shape and dtype, and the chunks that hold it."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    chunks: list[Chunk]

    @property
    def nbytes(self) -> int:
        return DTYPES[self.dtype].itemsize * math.prod(self.shape)


class ChunkedSource(Source):
    """A Source whose tensors are :class:`ChunkedTensor` records. A subclass fills
    ``_tensors`` (the selected state dict) and, for every chunk, ``_layouts`` (where its bytes
    lie) or overrides :meth:`_piece` to find that out when first asked."""

    def __init__(self, path: Location, format: str) -> None:
        super().__init__(path=path, format=format)
        self._reader = RangeReader()
        self._layouts: dict[Chunk, Piece] = {}
        self._tensors: dict[str, ChunkedTensor] = {}
        self._views = SpanViews()  # the chunks of the tensor being written as made pieces

    def _adopt_tree(self, build: Callable[[], Any], *, select: str | None, ema: bool) -> None:
        """Build the checkpoint's tree of values and :class:`ChunkedTensor` records (closing
        the files if that fails), find its state dict and take it, as in a ``.pt`` file."""
        try:
            tree = build()
            sel = select_state_dict(
                tree,
                lambda v: isinstance(v, ChunkedTensor),
                lambda v: v.nbytes,
                select=select,
                ema=ema,
                source=str(self.path),
            )
        except BaseException:
            self.close()
            raise
        self._tensors = dict(self.adopt(sel))

    def _piece(self, tensor: ChunkedTensor, chunk: Chunk) -> Piece:
        """Where a chunk's bytes lie in its file."""
        return self._layouts[chunk]

    def entries(self) -> list[tuple[str, TensorInfo]]:
        # Keys whose chunks are the very same records are one tensor (ties ckptkit wrote).
        return [
            (key, TensorInfo(t.dtype, t.shape, identity(t), (0, t.nbytes)))
            for key, t in self._tensors.items()
        ]

    def byte_pieces(self, key: str) -> list[Piece] | None:
        tensor = self._tensors[key]
        starts = [contiguous_start(tensor.shape, c) for c in tensor.chunks]
        if any(s is None for s in starts):
            return None
        order = sorted(zip(starts, tensor.chunks, strict=True), key=lambda sc: sc[0] or 0)
        return [self._piece(tensor, chunk) for _, chunk in order]

    def byte_span(self, key: str) -> Piece | None:
        pieces = self.byte_pieces(key)
        return pieces[0] if pieces is not None and len(pieces) == 1 else None

    def laid_out(self, key: str) -> Laid | None:
        """Chunks of any layout (column shards too) as a layout over their byte ranges, when
        every chunk lies in a local file."""
        tensor = self._tensors[key]
        spans: list[Span] = []
        for chunk in tensor.chunks:
            path, offset, length = self._piece(tensor, chunk)
            if not isinstance(path, Path):
                return None
            spans.append((path, offset, length))
        boxes = [(c.offsets, c.sizes) for c in tensor.chunks]
        layout = from_boxes(tensor.shape, DTYPES[tensor.dtype].itemsize, boxes)
        return None if layout is None else Laid(spans, layout)

    def made_pieces(self, key: str) -> list[memoryview] | None:
        """A tensor whose chunks are not one byte range each of it (column shards), written from
        views of its mapped chunks rather than assembled through torch."""
        if self.byte_pieces(key) is not None:
            return None  # copied range by range, and compared with them
        laid = self.laid_out(key)
        if laid is None:
            return None
        self._views.map(laid.spans)
        return self._views.views(laid.layout)

    def load(self, key: str) -> torch.Tensor:
        import torch

        from ckptkit.formats.base.tensors import as_bytes, torch_dtype

        tensor = self._tensors[key]
        out = torch.empty(tensor.shape, dtype=torch_dtype(tensor.dtype))
        # Chunks are placed as bytes: a copy in the tensor's dtype may rewrite them (a bool's
        # stored byte becomes 0 or 1).
        itemsize = DTYPES[tensor.dtype].itemsize
        grid = out.reshape(-1).view(torch.uint8).view(*tensor.shape, itemsize)
        for chunk in tensor.chunks:
            path, offset, length = self._piece(tensor, chunk)
            part = torch.empty((*chunk.sizes, itemsize), dtype=torch.uint8)
            self._reader.read([(path, offset, length)], as_bytes(part))
            index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
            grid[index] = part
        return out

    def close(self) -> None:
        self._reader.close()
        self._views.close()


def identity(tensor: ChunkedTensor) -> str:
    """The storage identity of a chunked tensor: its chunks' records (two keys over the same
    records are one tensor)."""
    # The whole path: rank files of one save share their names (Megatron's model_optim_rng.pt
    # in every mp_rank_* folder), and tensors at one offset of two of them are not one.
    return "chunks:" + (";".join(f"{c.file}@{c.start}" for c in tensor.chunks) or tensor.fqn)


def contiguous_start(shape: tuple[int, ...], chunk: Chunk) -> int | None:
    """The element where a chunk starts in the full tensor when it is one contiguous range of
    it (dims of size 1, then any one dim, then whole dims: a row shard), else None."""
    sizes = chunk.sizes
    first = next((i for i, size in enumerate(sizes) if size != 1), len(sizes))
    if any(sizes[i] != shape[i] for i in range(first + 1, len(shape))):
        return None
    start, stride = 0, 1
    for dim in reversed(range(len(shape))):
        start += chunk.offsets[dim] * stride
        stride *= shape[dim]
    return start


def check_cover(where: Location, tensor: ChunkedTensor) -> None:
    """The chunks lie inside the tensor, do not overlap, and cover it.

    Raises:
        FormatError: naming ``where`` and the key.
    """
    shape, total = tensor.shape, 0
    boxes: list[Chunk] = []
    for chunk in tensor.chunks:
        if (
            len(chunk.offsets) != len(shape)
            or len(chunk.sizes) != len(shape)
            or any(
                o < 0 or s < 0 or o + s > n
                for o, s, n in zip(chunk.offsets, chunk.sizes, shape, strict=True)
            )
        ):
            raise FormatError(f"{where} has a chunk of '{tensor.fqn}' outside its shape")
        for other in boxes:
            if all(
                o1 < o2 + s2 and o2 < o1 + s1
                for o1, s1, o2, s2 in zip(
                    chunk.offsets, chunk.sizes, other.offsets, other.sizes, strict=True
                )
            ):
                raise FormatError(
                    f"{where} has overlapping chunks of '{tensor.fqn}'",
                    "the folder mixes two saves; copy it again",
                )
        boxes.append(chunk)
        total += math.prod(chunk.sizes)
    if total != math.prod(shape):
        raise FormatError(
            f"{where} does not hold all of '{tensor.fqn}' ({total} of {math.prod(shape)} elements)",
            "a rank's file is missing; copy the whole folder",
        )
