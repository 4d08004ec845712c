"""A tensor laid out over local files (:class:`Laid`: the byte ranges it comes from and a
:class:`~ckptkit.formats.base.layout.Layout` over them), and the views that write it
(:class:`SpanViews`): each range mapped once, the tensor's pieces as views of the mappings,
which ``writev`` copies page cache to page cache with no copy in Python and no torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ckptkit.formats.base.layout import ZEROS, Layout
from ckptkit.storage.bytecopy import MappedRange, map_range, zeros

__all__ = ["Laid", "Span", "SpanViews"]

Span = tuple[Path, int, int]  # (a local file, offset, length)


@dataclass(frozen=True)
class Laid:
    """A tensor as ranges of local files (slot i of its layout is ``spans[i]``)."""

    spans: list[Span]
    layout: Layout


class SpanViews:
    """The mapped ranges of one set of spans (a tensor's, or a mapping group's) at a time."""

    def __init__(self) -> None:
        self._ranges: list[MappedRange] = []

    def map(self, spans: list[Span]) -> None:
        """Map ``spans`` (slot i is ``spans[i]``), releasing those mapped before."""
        self.release()
        for path, offset, count in spans:
            self._ranges.append(map_range(path, offset, count))

    def views(self, layout: Layout) -> list[memoryview]:
        """The layout's bytes as views of the mapped ranges (and of zeros, where it pads)."""
        ranges = [r.view for r in self._ranges]
        pieces: list[memoryview] = []
        for slot, offset, length in layout.pieces:
            if slot == ZEROS:
                pieces += zeros(length)
            else:
                pieces.append(ranges[slot][offset : offset + length])
        return pieces

    def of(self, laid: Laid) -> list[memoryview]:
        """A laid-out tensor's bytes as views: its spans mapped (those before released)."""
        self.map(laid.spans)
        return self.views(laid.layout)

    def bytes(self, layout: Layout) -> bytes:
        return b"".join(self.views(layout))

    def release(self) -> None:
        for mapped in self._ranges:
            mapped.close()
        self._ranges = []

    def close(self) -> None:
        self.release()
