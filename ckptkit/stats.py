"""``inspect --stats``: every tensor read once, at read speed, into min, max, mean, std and the
count of NaN and infinite values, so "is this download or this run broken?" has an answer.

Tensors whose bytes lie in a file as they are (safetensors, torch zips, shards) are read a piece
at a time straight from the file with NumPy (bf16 widened by a bit shift); the rest go through
the Source's ``load`` and torch. Memory holds one piece, never a tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.formats.base.dtypes import DTYPES
from ckptkit.formats.base.source import Source, TensorInfo, url_prefetcher
from ckptkit.storage.fetch import aligned
from ckptkit.storage.pieces import RangeReader

if TYPE_CHECKING:
    import numpy

__all__ = ["TensorStats", "tensor_stats", "stats_lines"]

PIECE = 4 * 1024 * 1024  # elements per step
# NumPy's names for the dtypes it reads as they are (bf16 is widened from uint16).
_NUMPY = {
    "float64": "<f8",
    "float32": "<f4",
    "float16": "<f2",
    "int64": "<i8",
    "int32": "<i4",
    "int16": "<i2",
    "int8": "i1",
    "uint8": "u1",
    "bool": "?",
    "bfloat16": "<u2",
}


@dataclass
class TensorStats:
    """One tensor's values summarised (min, max, mean, std over its finite values)."""

    elements: int
    nan: int = 0
    inf: int = 0
    minimum: float | None = None
    maximum: float | None = None
    mean: float | None = None
    std: float | None = None
    skipped: str = ""  # why a tensor has no statistics (a sparse or quantized one...)

    def to_dict(self) -> dict[str, Any]:
        return {
            "elements": self.elements,
            "min": self.minimum,
            "max": self.maximum,
            "mean": self.mean,
            "std": self.std,
            "nan": self.nan,
            "inf": self.inf,
            **({"skipped": self.skipped} if self.skipped else {}),
        }


class _Accumulator:
    """Running count, sum, sum of squares (in float64), extremes and non-finite counts."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.squares = 0.0
        self.low = math.inf
        self.high = -math.inf
        self.nan = 0
        self.inf = 0

    def add(self, np: Any, values: numpy.ndarray) -> None:
        """Count a 1-D NumPy piece in."""
        if values.dtype.kind == "f":
            finite = np.isfinite(values)
            if not finite.all():
                nan = int(np.isnan(values).sum())
                self.nan += nan
                self.inf += values.size - int(finite.sum()) - nan
                values = values[finite]
        if values.size == 0:
            return
        wide = values.astype(np.float64)
        self.count += wide.size
        self.total += float(wide.sum())
        self.squares += float(np.dot(wide, wide))
        self.low = min(self.low, float(wide.min()))
        self.high = max(self.high, float(wide.max()))

    def result(self, elements: int) -> TensorStats:
        if not self.count:
            return TensorStats(elements, self.nan, self.inf)
        mean = self.total / self.count
        variance = max(0.0, self.squares / self.count - mean * mean)
        return TensorStats(
            elements, self.nan, self.inf, self.low, self.high, mean, math.sqrt(variance)
        )


def _pieces_from_file(np: Any, source: Source, key: str, info: TensorInfo) -> Iterator[Any]:
    """A tensor's values from its byte range, ``PIECE`` elements at a time (None: not laid out
    as it is in a file, or a dtype NumPy does not read)."""
    span = source.local_span(key)
    if span is None or info.dtype not in _NUMPY:
        raise LookupError(key)
    path, offset, length = span
    mapped = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(length,))
    values = mapped.view(_NUMPY[info.dtype])
    for start in range(0, values.size, PIECE):
        piece = values[start : start + PIECE]
        if info.dtype == "bfloat16":  # the top half of a float32
            piece = (piece.astype(np.uint32) << 16).view(np.float32)
        yield piece


def _pieces_fetched(np: Any, fetcher: Any, key: str, info: TensorInfo) -> Iterator[Any]:
    """A tensor of a file at a URL, from its byte range fetched ahead (``url_prefetcher``)."""
    if fetcher is None or not fetcher.holds(key) or info.dtype not in _NUMPY:
        raise LookupError(key)
    for chunk in aligned(fetcher.pieces(key), DTYPES[info.dtype].itemsize):
        values = np.frombuffer(chunk, dtype=_NUMPY[info.dtype])
        for start in range(0, values.size, PIECE):
            piece = values[start : start + PIECE]
            if info.dtype == "bfloat16":  # the top half of a float32
                piece = (piece.astype(np.uint32) << 16).view(np.float32)
            yield piece


def _pieces_through_torch(np: Any, source: Source, key: str) -> Iterator[Any]:
    import torch

    flat = source.load(key).reshape(-1)
    for start in range(0, flat.numel(), PIECE):
        piece = flat[start : start + PIECE]
        if piece.is_complex():
            raise LookupError(key)
        wide = piece.to(torch.float64) if piece.is_floating_point() else piece.to(torch.int64)
        yield wide.numpy()


def tensor_stats(
    source: Source | str | Path, *, select: str | None = None, keys: list[str] | None = None
) -> dict[str, TensorStats]:
    """Statistics of every tensor of a checkpoint (a path, or an open Source), or of ``keys``,
    each tensor read once and never whole: min, max, mean and std of its finite values, and
    how many are NaN and how many infinite."""
    if not isinstance(source, Source):
        from ckptkit.formats.open import open_source

        with open_source(source, select=select) as opened:
            return tensor_stats(opened, keys=keys)
    import numpy as np

    entries = dict(source.entries())
    aliases = source.aliases()
    wanted = keys if keys is not None else list(entries)
    dense = [k for k in wanted if entries[k].kind == "dense" and k not in aliases]
    files = RangeReader()
    fetcher = url_prefetcher(source, dense, files)  # a file at a URL: fetched ahead
    try:
        return _all_stats(np, source, entries, aliases, wanted, fetcher)
    finally:
        if fetcher is not None:
            fetcher.close()
        files.close()


def _all_stats(
    np: Any,
    source: Source,
    entries: dict[str, TensorInfo],
    aliases: dict[str, str],
    wanted: list[str],
    fetcher: Any,
) -> dict[str, TensorStats]:
    out: dict[str, TensorStats] = {}
    for key in wanted:
        info = entries[key]
        if key in aliases and aliases[key] in out:  # a tied name: the same values
            out[key] = out[aliases[key]]
            continue
        if info.kind != "dense":
            out[key] = TensorStats(info.numel, skipped=info.kind)
            continue
        acc = _Accumulator()
        try:
            try:
                pieces = (
                    _pieces_fetched(np, fetcher, key, info)
                    if fetcher is not None and fetcher.holds(key)
                    else _pieces_from_file(np, source, key, info)
                )
                for piece in pieces:
                    acc.add(np, piece)
            except LookupError:
                for piece in _pieces_through_torch(np, source, key):
                    acc.add(np, piece)
        except LookupError:
            out[key] = TensorStats(info.numel, skipped=f"{info.dtype} values")
            continue
        out[key] = acc.result(info.numel)
    return out


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def stats_lines(stats: dict[str, TensorStats]) -> list[str]:
    """``inspect --stats``'s table, then one line on what is not finite."""
    rows: list[tuple[str, ...]] = [("key", "min", "max", "mean", "std", "nan", "inf")]
    for key, s in stats.items():
        if s.skipped:
            rows.append((key, f"({s.skipped})", "", "", "", "", ""))
            continue
        numbers = (s.minimum, s.maximum, s.mean, s.std)
        rows.append((key, *(_number(v) for v in numbers), str(s.nan), str(s.inf)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    bad = [key for key, s in stats.items() if s.nan or s.inf]
    if bad:
        lines.append(
            f"not finite  {len(bad)} of {len(stats)} tensors hold NaN or inf: {', '.join(bad[:5])}"
            + (" ..." if len(bad) > 5 else "")
        )
    else:
        lines.append(f"finite      every value of the {len(stats)} tensors")
    return lines
