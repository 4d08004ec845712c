"""``diff``: compare two checkpoints of any formats, wrapper chains normalised, tensor by tensor."""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.formats.base.dtypes import DTYPES
from ckptkit.formats.base.source import Source, TensorInfo, url_prefetcher
from ckptkit.formats.open import open_source
from ckptkit.keys import build_plan, match_keys
from ckptkit.progress import progress_bar
from ckptkit.storage.fetch import aligned
from ckptkit.storage.location import Location

if TYPE_CHECKING:
    import torch

__all__ = ["diff", "DiffReport", "TensorDiff"]
# Elements compared at a time: each widened float64 copy is 1 MB, so the dozen temporaries of a
# comparison stay near 12 MB beside torch's own ~220 MB (per-piece overhead: ~0.1 ms).
PIECE = 1 << 17


@dataclass
class TensorDiff:
    """How one common tensor compares: ``equal`` (bit-exact), ``close`` or ``different``."""

    key: str
    status: str
    max_abs: float = 0.0
    max_rel: float = 0.0
    differing: int = 0  # elements outside the tolerance
    dtypes: tuple[str, str] | None = None  # set when the two sides' dtypes differ

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "status": self.status,
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "differing": self.differing,
            "dtypes": list(self.dtypes) if self.dtypes else None,
        }


@dataclass
class Side:
    """One checkpoint as diff saw it."""

    path: str
    format: str
    removed: list[str]
    followed: list[str] = field(default_factory=list)  # files read from outside its folder

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "removed_prefixes": self.removed,
            "followed": self.followed,
        }


@dataclass
class DiffReport:
    """Keys only in A or B, header mismatches, and value differences of common tensors."""

    def __str__(self) -> str:
        """What ``ckptkit diff`` prints of it."""
        from ckptkit.render import diff_lines

        return "\n".join(diff_lines(self))

    a: Side
    b: Side
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, TensorInfo, TensorInfo]] = field(default_factory=list)
    tensors: list[TensorDiff] = field(default_factory=list)
    common: int = 0
    atol: float = 0.0
    rtol: float = 0.0
    keys_only: bool = False

    @property
    def different(self) -> list[TensorDiff]:
        return [t for t in self.tensors if t.status == "different"]

    @property
    def retyped(self) -> list[TensorDiff]:
        """Common tensors whose dtypes differ (their values were compared in the wider type)."""
        return [t for t in self.tensors if t.dtypes]

    @property
    def equal(self) -> bool:
        """No key or shape difference and every value bit-equal or within tolerance; a dtype
        difference counts only when comparing bit-exact (no tolerance given)."""
        bit_exact = self.atol == 0 and self.rtol == 0
        return not (
            self.only_a
            or self.only_b
            or self.mismatched
            or self.different
            or (bit_exact and self.retyped)
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``diff --json`` document."""
        return {
            "equal": self.equal,
            "a": self.a.to_dict(),
            "b": self.b.to_dict(),
            "common": self.common,
            "only_a": self.only_a,
            "only_b": self.only_b,
            "mismatched": [
                {"key": key, "a": a.to_dict(), "b": b.to_dict()} for key, a, b in self.mismatched
            ],
            "tensors": [t.to_dict() for t in self.tensors],
            "atol": self.atol,
            "rtol": self.rtol,
            "keys_only": self.keys_only,
        }


def _canonical(source: Source) -> tuple[dict[str, str], list[str]]:
    """Canonical key -> the key in the file, with the wrapper chain stripped."""
    plan = build_plan(source.keys(), strip_wrappers=True)
    return {new: old for old, new in plan.mapping.items() if new is not None}, plan.removed


def diff(
    a: str | Path,
    b: str | Path,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    keys_only: bool = False,
    select_a: str | None = None,
    select_b: str | None = None,
    variant_a: str | None = None,
    variant_b: str | None = None,
    names_from_a: str | Path | None = None,
    names_from_b: str | Path | None = None,
    allow_globals: Iterable[str] = (),
    progress: bool = False,
) -> DiffReport:
    """Compare two checkpoints after stripping each one's wrapper chain (and a leading prefix
    that only one side has, such as Lightning's ``model.``).

    Args:
        a, b: checkpoints of any supported format (a DDP ``.pt`` and its safetensors compare
            equal).
        atol, rtol: tolerance for values (``|a - b| <= atol + rtol * |b|``); 0 and 0 mean
            bit-exact.
        keys_only: compare keys, shapes and dtypes from the headers; read no tensor.
        select_a, select_b: where each state dict is inside a training checkpoint.
        variant_a, variant_b: in a model folder, the weights of this variant (``fp16``).
        names_from_a, names_from_b: the model a diffusers ``EMAModel`` state dict's
            ``shadow_params`` are named after, in order.
        allow_globals: pickle globals to admit beside torch's safe set.
        progress: show a progress bar (bytes of both sides) on stderr.

    Returns:
        The report; ``report.equal`` tells the verdict. Tensors of one dtype are compared as
        bytes (no torch, flat memory); others a piece at a time in the wider of the two types,
        so memory stays flat on any size.
    """
    with (
        _open_side("a", a, select_a, variant_a, names_from_a, allow_globals) as src_a,
        _open_side("b", b, select_b, variant_b, names_from_b, allow_globals) as src_b,
        _Reader() as reader,
        contextlib.ExitStack() as stack,
    ):
        keys_a, removed_a, keys_b, removed_b = _aligned_keys(src_a, src_b)
        info_a, info_b = dict(src_a.entries()), dict(src_b.entries())
        bar = None
        if progress and not keys_only:
            total = sum(i.nbytes for i in info_a.values()) + sum(i.nbytes for i in info_b.values())
            bar = stack.enter_context(progress_bar(total, "diff"))
        report = DiffReport(
            a=Side(str(a), src_a.format, removed_a, src_a.followed),
            b=Side(str(b), src_b.format, removed_b, src_b.followed),
            only_a=[k for k in keys_a if k not in keys_b],
            only_b=[k for k in keys_b if k not in keys_a],
            atol=atol,
            rtol=rtol,
            keys_only=keys_only,
        )
        if not keys_only:  # a side at a URL: its tensors fetched ahead, several at once
            compared = [
                k
                for k in keys_a
                if k in keys_b and info_a[keys_a[k]].shape == info_b[keys_b[k]].shape
            ]
            reader.prefetch(src_a, [keys_a[k] for k in compared])
            reader.prefetch(src_b, [keys_b[k] for k in compared])
        for key in (k for k in keys_a if k in keys_b):
            old_a, old_b = keys_a[key], keys_b[key]
            ia, ib = info_a[old_a], info_b[old_b]
            report.common += 1
            if ia.shape != ib.shape or (keys_only and ia.dtype != ib.dtype):
                report.mismatched.append((key, ia, ib))
            elif not keys_only:
                pair = ((src_a, old_a, ia), (src_b, old_b, ib))
                report.tensors.append(_compare_tensor(reader, key, *pair, atol=atol, rtol=rtol))
                if bar is not None:
                    bar.update(ia.nbytes + ib.nbytes)
    return report


def _open_side(
    side: str,
    path: str | Path,
    select: str | None,
    variant: str | None,
    names_from: str | Path | None,
    allow_globals: Iterable[str],
) -> Source:
    """One side, its errors' fixes in diff's words (``--names-from-a``, not convert's
    ``--ema --names-from``)."""
    try:
        return open_source(
            path, select=select, variant=variant, names_from=names_from, allow_globals=allow_globals
        )
    except CkptkitError as exc:
        if exc.hint and "--names-from" in exc.hint:
            exc.hint = exc.hint.replace("--ema --names-from", "--names-from").replace(
                "--names-from", f"--names-from-{side}"
            )
            if exc.api_hint:
                exc.api_hint = exc.api_hint.replace("ema=True, ", "").replace(
                    "names_from=", f"names_from_{side}="
                )
        raise


def _aligned_keys(
    src_a: Source, src_b: Source
) -> tuple[dict[str, str], list[str], dict[str, str], list[str]]:
    """Each side's keys without its wrapper chain (canonical key -> its key), and the prefixes
    removed from each; beyond wrappers, a shared prefix only one side has (Lightning's
    ``model.``) is matched away too."""
    keys_a, removed_a = _canonical(src_a)
    keys_b, removed_b = _canonical(src_b)
    match = match_keys(keys_a, keys_b)
    if sum(new in keys_b for new in match.mapping.values()) > len(keys_a.keys() & keys_b.keys()):
        keys_a = {new: old for k, old in keys_a.items() if (new := match.mapping[k])}
        removed_a += match.removed
        removed_b += match.added
    return keys_a, removed_a, keys_b, removed_b


def _compare_tensor(
    reader: _Reader,
    key: str,
    a: tuple[Source, str, TensorInfo],
    b: tuple[Source, str, TensorInfo],
    *,
    atol: float,
    rtol: float,
) -> TensorDiff:
    """One tensor of each side: equal bytes when the dtypes agree, else compared a piece at a
    time in the wider type."""
    (src_a, old_a, ia), (src_b, old_b, ib) = a, b
    span_a, span_b = src_a.local_span(old_a), src_b.local_span(old_b)
    if ia.dtype == ib.dtype and reader.same_bytes(span_a, span_b):
        return TensorDiff(key, "equal")
    # NumPy where it can (imports in 0.06 s; torch takes a second and 200 MB).
    np = _numpy_for(ia, ib) if span_a and span_b else None
    pieces_a = reader.pieces(src_a, old_a, ia, span_a, np)
    pieces_b = reader.pieces(src_b, old_b, ib, span_b, np)
    result = compare_pieces(key, pieces_a, pieces_b, atol=atol, rtol=rtol)
    if ia.dtype != ib.dtype:
        result.dtypes = (ia.dtype, ib.dtype)
    return result


class _Reader:
    """Reads tensor bytes for diff: raw byte ranges compared in place, or pieces read into two
    reused buffers per side, so nothing the size of a tensor is ever in memory."""

    def __init__(self) -> None:
        from ckptkit.storage.pieces import RangeReader

        self._files = RangeReader()
        self._fetchers: dict[int, Any] = {}  # id(source) -> its Prefetcher (a URL's tensors)

    def prefetch(self, source: Source, keys: list[str]) -> None:
        """A source at a URL: the byte ranges of ``keys`` (in the order they will be compared)
        fetched ahead, a few requests at a time; memory holds those requests, not tensors."""
        fetcher = url_prefetcher(source, keys, self._files)
        if fetcher is not None:
            self._fetchers[id(source)] = fetcher

    def same_bytes(
        self, a: tuple[Location, int, int] | None, b: tuple[Location, int, int] | None
    ) -> bool:
        if a is None or b is None or a[2] != b[2]:
            return False
        from ckptkit.storage.bytecopy import same_bytes

        return same_bytes(self._files.fd(a[0]), a[1], self._files.fd(b[0]), b[1], a[2])

    def pieces(
        self,
        source: Source,
        key: str,
        info: TensorInfo,
        span: tuple[Location, int, int] | None,
        np: Any = None,
    ) -> Iterator[Any]:
        """The tensor's elements in order, ``PIECE`` at a time, as 1-D NumPy arrays (given the
        module) or tensors."""
        if np is not None:
            make = functools.partial(np.frombuffer, dtype=_NUMPY_DTYPES[info.dtype])
        else:
            import torch

            from ckptkit.formats.base.tensors import torch_dtype

            make = functools.partial(torch.frombuffer, dtype=torch_dtype(info.dtype))
        step = PIECE * DTYPES[info.dtype].itemsize
        fetcher = self._fetchers.get(id(source))
        if span is None and fetcher is not None and fetcher.holds(key):
            yield from map(make, aligned(fetcher.pieces(key), DTYPES[info.dtype].itemsize))
            return
        if span is None:
            # Compressed (a deflated zip member): decompressed a piece at a time, never whole.
            chunks = source.stream(key, step)
            if chunks is not None:
                yield from map(make, chunks)
                return
            # Strided: through the reader, a row block at a time.
            yield from _flat_pieces(source.load(key))
            return
        path, offset, length = span
        for start in range(0, length, step):
            # A buffer each: pieces may be compared on two threads at once.
            view = bytearray(min(step, length - start))
            self._files.read([(path, offset + start, len(view))], memoryview(view))
            yield make(view)

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        for fetcher in self._fetchers.values():
            fetcher.close()
        self._files.close()


def _flat_pieces(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """A (possibly strided) tensor's elements in order, about ``PIECE`` at a time: views of
    contiguous runs, or small copies of row blocks."""
    if tensor.is_contiguous():
        flat = tensor.reshape(-1)
        for start in range(0, flat.numel(), PIECE):
            yield flat[start : start + PIECE]
        return
    if tensor.dim() <= 1 or tensor[0].numel() <= PIECE:
        rows = max(1, PIECE // max(1, tensor[0].numel() if tensor.dim() else 1))
        for start in range(0, tensor.shape[0] if tensor.dim() else 1, rows):
            yield tensor[start : start + rows].reshape(-1)
        return
    for row in tensor:
        yield from _flat_pieces(row)


def compare_pieces(
    key: str,
    pieces_a: Iterable[Any],
    pieces_b: Iterable[Any],
    *,
    atol: float,
    rtol: float,
) -> TensorDiff:
    """Compare two tensors given as matching 1-D pieces (NumPy arrays or tensors, the same kind
    on both sides): bit-equal, within tolerance, or not. Values are compared in the wider of
    the two dtypes (at least float32; float64 through torch or with integers), NaN equal to
    NaN."""
    max_abs = max_rel = 0.0
    differing = 0
    bit_equal = True
    for same, bad, most_abs, most_rel in _stats_of(_even(pieces_a), _even(pieces_b), atol, rtol):
        if same:
            continue
        bit_equal = False
        differing += bad
        max_abs, max_rel = max(max_abs, most_abs), max(max_rel, most_rel)
    if bit_equal:
        return TensorDiff(key, "equal")
    if not max_rel:
        max_rel = max_abs
    if not differing and not max_abs:  # other dtypes, the very same values
        return TensorDiff(key, "equal")
    return TensorDiff(key, "close" if not differing else "different", max_abs, max_rel, differing)


def _stats_of(
    pieces_a: Iterator[Any], pieces_b: Iterator[Any], atol: float, rtol: float
) -> Iterator[tuple[bool, int, float, float]]:
    """Each pair's stats; NumPy pairs two at a time on two threads (its loops release the GIL),
    torch's one at a time (its memory beside torch's own is what must stay small)."""
    pairs = zip(pieces_a, pieces_b, strict=True)
    first = next(pairs, None)
    if first is None:
        return
    if type(first[0]).__module__ != "numpy":
        for a, b in itertools.chain([first], pairs):
            yield _torch_stats(a, b, atol, rtol)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckptkit-diff") as pool:
        batch = [first]
        for pair in itertools.chain(pairs, [None]):
            if pair is not None and len(batch) < 2:
                batch.append(pair)
                continue
            yield from pool.map(lambda ab: _numpy_stats(ab[0], ab[1], atol, rtol), batch)
            batch = [pair] if pair is not None else []


def _torch_stats(a: Any, b: Any, atol: float, rtol: float) -> tuple[bool, int, float, float]:
    """(bit-equal, elements out of tolerance, max abs gap, max relative gap) of two pieces."""
    import torch

    if a.dtype == b.dtype and torch.equal(_bytes_of(a), _bytes_of(b)):
        return True, 0, 0.0, 0.0
    wide = torch.complex128 if a.is_complex() or b.is_complex() else torch.float64
    da, db = a.to(wide, copy=True), b.to(wide, copy=True)
    both_nan = torch.isnan(da) & torch.isnan(db)
    gap = da.sub_(db).abs()
    gap.masked_fill_(both_nan, 0)  # NaN equals NaN; any other NaN gap counts as different
    scale = db.abs_() if not db.is_complex() else db.abs()
    bad = int((~(gap <= scale * rtol + atol)).sum())
    if not gap.numel():
        return False, bad, 0.0, 0.0
    most_abs = float(gap.nan_to_num(nan=0.0).max())
    most_rel = float(gap.div_(scale).nan_to_num_(nan=0.0, posinf=0.0).max())
    return False, bad, most_abs, most_rel


def _numpy_stats(a: Any, b: Any, atol: float, rtol: float) -> tuple[bool, int, float, float]:
    import numpy as np

    # Bytes first (memcmp): most pieces of a changed checkpoint are unchanged.
    if a.dtype == b.dtype and memoryview(a).cast("B") == memoryview(b).cast("B"):
        return True, 0, 0.0, 0.0
    if not a.size:
        return False, 0, 0.0, 0.0
    wide = _numpy_wide(np, a.dtype, b.dtype)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        gap = np.subtract(a, b, dtype=wide)  # cast on the fly: one pass, one array
        gap = np.abs(gap, out=gap) if gap.dtype.kind == "f" else np.abs(gap)
        scale = np.abs(b.astype(wide, copy=False))
        most_abs = float(gap.max())  # NaN when any gap is: only then look for NaN
        if most_abs != most_abs:
            gap[np.isnan(a) & np.isnan(b)] = 0  # NaN equals NaN; other NaN gaps differ
            most_abs = float(np.fmax.reduce(gap))  # fmax skips NaN
        limit = scale * rtol + atol if rtol else atol
        bad = int(gap.size - np.count_nonzero(gap <= limit))
        np.divide(gap, scale, out=gap)
        gap[np.isinf(gap)] = 0  # a zero scale has no ratio (0/0 is NaN, which fmax skips)
        most_rel = float(np.fmax.reduce(gap))
    return False, bad, most_abs, most_rel


def _numpy_wide(np: Any, a: Any, b: Any) -> Any:
    """The wider of two dtypes to compare values in: at least float32 for floats (a float16
    gap could overflow), float64 once an integer or bool is involved, complex for complex."""
    if a.kind == "c" or b.kind == "c":
        return np.result_type(a, b, np.complex64)
    if a.kind == "f" and b.kind == "f":
        return np.result_type(a, b, np.float32)
    return np.float64


# dtypes NumPy holds as they are on disk (little-endian); bf16 and float8 go through torch.
_NUMPY_DTYPES = {
    "float64": "<f8", "float32": "<f4", "float16": "<f2", "int64": "<i8", "int32": "<i4",
    "int16": "<i2", "int8": "i1", "uint64": "<u8", "uint32": "<u4", "uint16": "<u2",
    "uint8": "u1", "bool": "?", "complex64": "<c8", "complex128": "<c16",
}  # fmt: skip


def _numpy_for(a: TensorInfo, b: TensorInfo) -> Any:
    """The numpy module when it is installed and holds both dtypes, else None (torch then)."""
    if a.dtype not in _NUMPY_DTYPES or b.dtype not in _NUMPY_DTYPES:
        return None
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _even(pieces: Iterable[Any]) -> Iterator[Any]:
    """The same elements in pieces of exactly ``PIECE`` (the last shorter), so pieces read one
    way on one side and another way on the other line up."""
    pending: list[Any] = []
    count = 0

    def joined() -> Any:
        if len(pending) == 1:
            return pending[0]
        if type(pending[0]).__module__ == "numpy":
            import numpy

            return numpy.concatenate(pending)
        import torch

        return torch.cat(pending)

    for piece in pieces:
        size = len(piece) if piece.ndim else 1
        piece = piece.reshape(-1) if not piece.ndim else piece
        while size:
            take = min(PIECE - count, size)
            pending.append(piece[:take])
            count += take
            piece, size = piece[take:], size - take
            if count == PIECE:
                yield joined()
                pending, count = [], 0
    if pending:
        yield joined()


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    import torch

    flat = tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().reshape(-1)
    return flat.view(torch.uint8)
