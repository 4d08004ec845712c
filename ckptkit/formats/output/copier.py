"""The copy engine: a Source's tensors into an open output file, and checks of what was written.

A tensor whose bytes lie in the source file as they must in the output (contiguous, same dtype)
is copied file to file (see ``bytecopy``), never entering Python objects, and torch is not even
imported; any other tensor (strided, cast, compressed) goes through torch a piece at a time.
Copied bytes are compared with their source range in a worker thread while the next tensors are
written (handed over in batches: a future per tensor cost 1.3 kB, 130 MB for 100,000 tensors);
the rest are compared with output bytes made again from the source. Where each format
puts a tensor is the business of the writers (``writers.py``), which call this engine.
"""

from __future__ import annotations

import os
import zlib
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkit.errors import FormatError, VerificationError
from ckptkit.formats.base.dtypes import DTYPES, TensorSpec
from ckptkit.formats.base.source import Source
from ckptkit.storage.backends.base import Remote
from ckptkit.storage.bytecopy import (
    COMPARE_CHUNK,
    IOV_MAX,
    batched,
    copy_range,
    read_into,
    release_pages,
    same_bytes,
    write_all,
    write_all_of,
)
from ckptkit.storage.fetch import Prefetcher
from ckptkit.storage.location import Location
from ckptkit.storage.pieces import RangeReader

if TYPE_CHECKING:
    import torch

__all__ = [
    "Item",
    "Copier",
    "PIECE",
    "differs",
    "check_keys",
    "check_layout",
    "ties_differ",
    "metadata_differ",
]

PIECE = 4 * 1024 * 1024  # output bytes per step of a tensor that goes through torch
RELEASE_AFTER = 256 * 1024 * 1024  # written bytes before a range leaves the page cache
# Written ranges go to the worker thread in batches of this many, or of this many bytes...
BATCH_RANGES, BATCH_BYTES = 512, 64 * 1024 * 1024
PENDING_BATCHES = 4  # ...and at most this many batches wait for it (then the writer waits)

# One written range for the worker: (key, source (fd, offset), the CRC-32 of bytes fetched from
# a URL, or None; output fd, offset, count)
_Range = tuple[str, "tuple[int, int] | int | None", int, int, int]


@dataclass(frozen=True)
class Item:
    """One output tensor: where it comes from and what it becomes."""

    old: str
    spec: TensorSpec
    source_dtype: str

    @property
    def cast(self) -> bool:
        return self.spec.dtype != self.source_dtype


@dataclass
class Copier:
    """Copies items from ``source`` into output files; counts how each went and which casts
    overflowed, and keeps the comparisons of copied bytes until a writer's check asks."""

    source: Source
    progress: Callable[[int], None] = lambda nbytes: None
    copied: int = 0
    through_torch: int = 0
    made: int = 0  # of the copied: made from views of their ranges, checked by CRC-32
    overflowed: list[str] = field(default_factory=list)
    _files: RangeReader = field(default_factory=RangeReader)
    _checker: ThreadPoolExecutor | None = None
    _batch: list[_Range] = field(default_factory=list)  # ranges not handed over yet
    _batch_bytes: int = 0
    _pending: deque[Future[None]] = field(default_factory=deque)  # batches handed over
    _compared: set[str] = field(default_factory=set)  # keys whose copied bytes are compared
    _differ: set[str] = field(default_factory=set)  # ...and those found different
    _failed: dict[str, BaseException] = field(default_factory=dict)  # ...or not compared
    _flushing: _Ranges = field(default_factory=lambda: _Ranges())  # written, still cached
    _flushing_bytes: int = 0
    workers: int = 8  # ranged requests in flight for a source at a URL
    # Set for an output uploaded as it is written (``storage/upload.py``): called in the worker
    # thread with (fd, start, end) once a range is written and checked, in the order written;
    # the bytes made through torch are checked by their CRC-32 as written, since the file
    # will no longer hold them when the writer's check comes.
    on_settled: Callable[[int, int, int], None] | None = None
    crc_made: bool = False
    batch_bytes: int = BATCH_BYTES  # smaller for a streamed output: its disk use follows it
    _fetcher: Prefetcher | None = None
    _sources_remotes: dict[str, Remote] | None = None  # the source's own, by URL

    def close(self) -> None:
        try:
            self._drain()
        finally:
            if self._checker is not None:
                self._checker.shutdown(wait=True)
            if self._fetcher is not None:  # its threads read through _files' connections
                self._fetcher.close()
            self._files.close()

    def _written(
        self, key: str, dst: Path, start: int, count: int, source: tuple[int, int] | int | None
    ) -> None:
        """After a tensor's bytes are written, hand them to the worker thread (see
        :meth:`_settle`), which works while the next tensors are written."""
        if source is not None:
            self._compared.add(key)
        self._batch.append((key, source, self.fd(dst), start, count))
        self._batch_bytes += count
        if len(self._batch) >= BATCH_RANGES or self._batch_bytes >= self.batch_bytes:
            self._hand_over()

    def _hand_over(self) -> None:
        """Give the worker the ranges written since the last batch; wait for the oldest batch
        first when too many wait already (memory holds a few batches, not the whole file)."""
        if not self._batch:
            return
        if self._checker is None:
            self._checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptkit-verify")
        while len(self._pending) >= PENDING_BATCHES:
            self._pending.popleft().result()
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        self._pending.append(self._checker.submit(self._settle_all, batch))

    def _drain(self) -> None:
        """Every range written so far compared (and its write-back started)."""
        self._hand_over()
        while self._pending:
            self._pending.popleft().result()

    def _settle_all(self, batch: list[_Range]) -> None:
        """In the worker thread: each range of a batch, in order (see :meth:`_settle`)."""
        for key, source, fd, start, count in batch:
            try:
                if not self._settle(source, fd, start, count):
                    self._differ.add(key)
            except Exception as exc:  # kept for checked(), which raises it
                if source is not None:
                    self._failed.setdefault(key, exc)
            if self.on_settled is not None:  # its failure fails the conversion (result())
                self.on_settled(fd, start, start + count)

    def _settle(
        self, source: tuple[int, int] | int | None, fd: int, start: int, count: int
    ) -> bool:
        """In the worker thread: compare a written range with its ``source`` range (fd, offset)
        or the CRC-32 of the bytes fetched for it when given, then start its write-back, so the
        final fsync finds little left to do.

        Ranges written ``RELEASE_AFTER`` bytes earlier, on disk by now, leave the page cache,
        as with ``dd oflag=nocache``: a conversion does not push a checkpoint's worth of other
        files out of memory, and the pages it frees are the ones it writes into next (on a VM,
        pages the host has taken back are slow to touch again: 0.52 s instead of 1.08 s here).
        """
        if isinstance(source, int):  # fetched from a URL: the CRC-32 of what came
            same = _crc_of(fd, start, count) == source
        else:
            same = source is None or same_bytes(*source, fd, start, count)
        release_pages(fd, start, count)  # compared first: released pages may leave the cache
        self._flushing.append(fd, start, count)
        self._flushing_bytes += count
        while self._flushing_bytes - self._flushing.first_count() >= RELEASE_AFTER:  # since
            fd, start, count = self._flushing.popleft()
            self._flushing_bytes -= count
            release_pages(fd, start, count)
        return same

    def fd(self, path: Location) -> int:
        """An open descriptor of ``path`` (the source's files and the outputs alike)."""
        return self._files.fd(path)

    def forget(self, path: Path) -> None:
        """Close the descriptor of an output that is done with: every range checked first,
        and every written range out of the page cache (none is left naming a closed fd)."""
        self._drain()
        while len(self._flushing):
            release_pages(*self._flushing.popleft())
        self._flushing_bytes = 0
        self._files.forget(path)

    def checked(self, key: str) -> bool | None:
        """Whether the copied bytes of ``key`` matched their source as they were written; None
        for a tensor that went through torch (compared with :meth:`same_as_pieces`)."""
        if key not in self._compared:
            return None
        if self._batch or self._pending:
            self._drain()
        self._compared.discard(key)
        if key in self._failed:
            raise self._failed.pop(key)
        return key not in self._differ

    def tensor(self, item: Item) -> torch.Tensor:
        """The output tensor as torch sees it: loaded, cast if asked, contiguous."""
        from ckptkit.formats.base.tensors import torch_dtype

        tensor = self.source.load(item.old)
        if item.cast:
            tensor = tensor.to(torch_dtype(item.spec.dtype))
        return tensor.contiguous()

    def _pieces(self, item: Item) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """A tensor that goes through torch as (source piece, output piece) pairs of about
        ``PIECE`` output bytes, in output order.

        The source tensor is a view of the mapped file and each piece is cast into one reused
        buffer, so memory holds a piece, not the tensor (only a strided tensor is copied whole
        once, to lay it out flat). Allocating nothing per piece also keeps glibc from hoarding
        freed memory: a fresh cast tensor each time grew the heap by 16 MB per tensor. A tensor
        that must be decompressed (a deflated zip member) comes a piece at a time from the
        source's :meth:`~Source.stream`, never whole.
        """
        import torch

        from ckptkit.formats.base.tensors import from_buffer, torch_dtype

        step = max(1, PIECE // DTYPES[item.spec.dtype].itemsize)
        chunks = self.source.stream(item.old, step * DTYPES[item.source_dtype].itemsize)
        if chunks is not None:
            cast_into = torch.empty(step if item.cast else 0, dtype=torch_dtype(item.spec.dtype))
            for chunk in chunks:
                piece = from_buffer(chunk, 0, len(chunk), item.source_dtype)
                yield piece, (cast_into[: len(piece)].copy_(piece) if item.cast else piece)
            return
        flat = self.source.load(item.old).reshape(-1)  # a view, unless the tensor is strided
        cast_into = torch.empty(min(step, flat.numel()), dtype=torch_dtype(item.spec.dtype))
        for begin in range(0, flat.numel(), step):
            piece = flat[begin : begin + step]
            # A 1-D strided tensor stays a strided view through reshape: copy it a piece at a
            # time (a no-op for contiguous pieces).
            yield piece, (cast_into[: len(piece)].copy_(piece) if item.cast else piece.contiguous())

    def tensor_writer(
        self, items: dict[str, Item], dst: Path, verify: bool
    ) -> Callable[[int, TensorSpec], None]:
        """``write(fd, spec)``: append the output bytes of ``items[spec.key]`` at ``fd`` (a file
        of ``dst``); with ``verify``, copied bytes are compared as they are written. ``items``
        are in the order they will be written: a source at a URL has them fetched ahead."""
        fetcher = self._prefetcher(items)

        def write(fd: int, spec: TensorSpec) -> None:
            item = items[spec.key]
            pieces = None if item.cast else self.source.byte_pieces(item.old)
            if fetcher is not None and fetcher.holds(spec.key):  # its bytes lie at a URL
                self._write_fetched(fetcher, fd, dst, item, verify)
            elif pieces is not None:
                for path, offset, length in pieces:  # one range, or a sharded layout's several
                    start = os.lseek(fd, 0, os.SEEK_CUR)
                    copy_range(self.fd(path), offset, length, fd)
                    compare = (self.fd(path), offset) if verify else None
                    self._written(spec.key, dst, start, length, compare)
                self.copied += 1
            elif (made := None if item.cast else self.source.made_pieces(item.old)) is not None:
                start = os.lseek(fd, 0, os.SEEK_CUR)
                crc = 0
                for batch in batched(made, IOV_MAX):  # one copy: the source's pages to the output's
                    write_all_of(fd, batch)
                    for view in batch if verify else ():
                        crc = zlib.crc32(view, crc)
                # Checked by the CRC-32 of its bytes as made: the source is not read again.
                self._written(spec.key, dst, start, spec.nbytes, crc if verify else None)
                self.copied += 1
                self.made += 1
            else:
                start = os.lseek(fd, 0, os.SEEK_CUR)
                overflowed, crc = False, 0
                for before, after in self._pieces(item):
                    overflowed = overflowed or (item.cast and _overflows(before, after))
                    write_all(fd, _raw(after))
                    crc = zlib.crc32(_raw(after), crc) if self.crc_made else 0
                if overflowed:
                    self.overflowed.append(spec.key)
                # Compared in the end (made again from the source), or by its CRC-32 now.
                self._written(spec.key, dst, start, spec.nbytes, crc if self.crc_made else None)
                self.through_torch += 1
            self.progress(spec.nbytes)

        return write

    def _prefetcher(self, items: dict[str, Item]) -> Prefetcher | None:
        """For a source whose tensors lie in files at URLs: their ranges fetched ahead,
        ``workers`` at once (a local file's are copied by the kernel instead)."""
        spans = []
        for item in items.values():
            pieces = None if item.cast else self.source.byte_pieces(item.old)
            remotes = [self._remote(path) for path, _, _ in pieces or ()]
            if pieces and all(remotes):
                spans += [
                    (item.spec.key, remote, offset, length)
                    for remote, (_, offset, length) in zip(remotes, pieces, strict=True)
                    if remote is not None
                ]
        if not spans:
            return None
        if self._fetcher is not None:
            self._fetcher.close()
        self._fetcher = Prefetcher(spans, workers=self.workers)
        return self._fetcher

    def _remote(self, url: Any) -> Remote | None:
        """One Remote (its connections) per URL, for the whole conversion: the source's own
        where it has one (its size known, its first bytes fetched), else one opened here;
        None for a local file."""
        if self._sources_remotes is None:
            self._sources_remotes = _remotes_of(self.source)
        return self._sources_remotes.get(str(url)) or self._files.remote(url)

    def _write_fetched(
        self, fetcher: Prefetcher, fd: int, dst: Path, item: Item, verify: bool
    ) -> None:
        """A tensor of a file at a URL: its bytes as they come, written in order; their CRC-32
        checked against the zip member's where the file records one, and, with ``verify``,
        against the bytes read back from the output (by the worker thread)."""
        start = os.lseek(fd, 0, os.SEEK_CUR)
        crc = 0
        for data in fetcher.pieces(item.spec.key):
            write_all(fd, memoryview(data))
            crc = zlib.crc32(data, crc)
        expected = self.source.expected_crc(item.old)
        if expected is not None and expected != crc:
            raise FormatError(
                f"tensor '{item.old}' fetched from {self.source.path} does not match the "
                f"CRC-32 its zip records; nothing was written",
                "run it again (the object may have changed while it was read)",
            )
        self._written(item.spec.key, dst, start, item.spec.nbytes, crc if verify else None)
        self.copied += 1

    def same_as_pieces(self, fd: int, offset: int, item: Item) -> bool:
        """True when the file holds, from ``offset``, the output bytes of ``item`` made anew."""
        buf = bytearray()
        for _, after in self._pieces(item):
            piece = _raw(after)
            if len(buf) != len(piece):
                buf = bytearray(len(piece))
            if not read_into(fd, buf, offset) or buf != piece:  # bytearray == view: memcmp
                return False
            offset += len(buf)
        return True

    def compare(
        self, written: Source, items: list[Item], aliases: dict[str, str], shown: Path
    ) -> None:
        """What a reader gives of a written output against the plan: keys, ties, dtypes and
        shapes, then every tensor's bytes (each one range of the output)."""
        entries = dict(written.entries())
        check_keys(shown, [i.spec.key for i in items], entries)
        if written.aliases() != aliases:
            raise ties_differ(shown, aliases, written.aliases())
        for item in items:
            info = entries[item.spec.key]
            check_layout(shown, item.spec, info.dtype, info.shape)
            pieces = written.byte_pieces(item.spec.key)
            if pieces is None or len(pieces) != 1:  # a reader of ckptkit's output finds one range
                raise VerificationError(
                    f"tensor '{item.spec.key}' in {shown} is not one range of bytes; "
                    "nothing was written"
                )
            if item.spec.key not in aliases:  # an alias's bytes are its target's, checked there
                self.check_bytes(item, pieces[0][0], pieces[0][1], shown)
            self.progress(item.spec.nbytes)

    def check_bytes(self, item: Item, path: Location, offset: int, shown: Path) -> None:
        """One written tensor's bytes: copied ones as compared while written, the rest made
        again from the source."""
        same = self.checked(item.spec.key)
        if same is None:
            same = self.same_as_pieces(self.fd(path), offset, item)
        if not same:
            raise differs(item.spec.key, shown)


class _Ranges:
    """A queue of (fd, offset, count) ranges in three arrays: 20 bytes a range, where a deque
    of tuples took 120 (every range of 100,000 small tensors waits in it)."""

    def __init__(self) -> None:
        self.fds, self.starts, self.counts = array("i"), array("q"), array("q")
        self.head = 0

    def append(self, fd: int, start: int, count: int) -> None:
        self.fds.append(fd)
        self.starts.append(start)
        self.counts.append(count)

    def first_count(self) -> int:
        return self.counts[self.head]

    def __len__(self) -> int:
        return len(self.fds) - self.head

    def popleft(self) -> tuple[int, int, int]:
        at = self.head
        out = self.fds[at], self.starts[at], self.counts[at]
        self.head += 1
        if self.head >= 4096 and 2 * self.head >= len(self.fds):  # drop what was taken
            for column in (self.fds, self.starts, self.counts):
                del column[: self.head]
            self.head = 0
        return out


def differs(key: str, shown: Path) -> VerificationError:
    """The error for a tensor whose bytes read back differ from the source."""
    return VerificationError(
        f"tensor '{key}' read back from {shown} differs from the source; nothing was written",
        "report this with CKPTKIT_DEBUG=1 output",
    )


def _some(names: Iterable[str], limit: int = 5) -> str:
    names = sorted(names)
    shown = ", ".join(f"'{n}'" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_keys(shown: Path, planned: Iterable[str], found: Iterable[str]) -> None:
    """Refuse an output whose keys read back are not the planned ones, naming the difference."""
    planned, found = set(planned), set(found)
    if planned == found:
        return
    parts = [f"missing {_some(planned - found)}"] if planned - found else []
    parts += [f"unexpected {_some(found - planned)}"] if found - planned else []
    raise VerificationError(
        f"{shown} would not hold the planned keys ({'; '.join(parts)}); nothing was written"
    )


def check_layout(shown: Path, spec: TensorSpec, dtype: str, shape: Iterable[int]) -> None:
    """Refuse a tensor read back with another dtype or shape than planned, naming both."""
    if (dtype, tuple(shape)) != (spec.dtype, tuple(spec.shape)):
        raise VerificationError(
            f"tensor '{spec.key}' in {shown} has the wrong shape or dtype: read back "
            f"{dtype} {list(shape)}, planned {spec.dtype} {list(spec.shape)}; nothing was written"
        )


def ties_differ(shown: Path, planned: dict[str, str], found: dict[str, str]) -> VerificationError:
    """The error for ties read back that are not the planned ones, naming the names that differ."""
    names = {k for k in planned.keys() | found.keys() if planned.get(k) != found.get(k)}
    detail = "; ".join(
        f"'{k}': planned {planned.get(k)!r}, read {found.get(k)!r}" for k in sorted(names)[:5]
    )
    return VerificationError(f"the ties read back from {shown} differ from the plan ({detail})")


def metadata_differ(
    shown: Path, planned: dict[str, str], found: dict[str, str]
) -> VerificationError:
    """The error for metadata read back that is not what was written, naming the keys."""
    names = {k for k in planned.keys() | found.keys() if planned.get(k) != found.get(k)}
    return VerificationError(
        f"the metadata read back from {shown} differs (in {_some(names)}); nothing was written"
    )


def _remotes_of(source: Source) -> dict[str, Remote]:
    """The Remotes a source (and the shards or the base it reads) already holds, by URL."""
    found: dict[str, Remote] = {}
    raw = source.remote_file
    if raw is not None:
        found[str(source.path)] = raw.remote
    for inner in (getattr(source, "base", None), getattr(source, "inner", None)):
        if isinstance(inner, Source) and inner is not source:
            found.update(_remotes_of(inner))
    for shard in getattr(source, "shards", {}).values():
        found.update(_remotes_of(shard))
    return found


def _crc_of(fd: int, start: int, count: int) -> int:
    """The CRC-32 of a file's range, read a window at a time."""
    crc, buf = 0, bytearray(min(count, COMPARE_CHUNK) or 1)
    for at in range(start, start + count, len(buf)):
        view = memoryview(buf)[: min(len(buf), start + count - at)]
        if not read_into(fd, view, at):
            return -1
        crc = zlib.crc32(view, crc)
    return crc


def _raw(tensor: Any) -> memoryview:
    from ckptkit.formats.base.tensors import as_bytes

    return as_bytes(tensor)


def _overflows(before: Any, after: Any) -> bool:
    """Finite values that became infinite in the cast."""
    import torch

    # The smallest and largest values are finite (NaN propagates) exactly when every value is:
    # one pass and no allocation. Only a cast with inf or NaN in it needs the masks below.
    if after.numel() == 0 or all(torch.isfinite(v) for v in torch.aminmax(after)):
        return False
    before, after = before.reshape(-1), after.reshape(-1)
    step = max(1, PIECE // 4)  # the masks a piece at a time, never as large as the tensor
    for begin in range(0, before.numel(), step):
        end = begin + step
        if (torch.isfinite(before[begin:end]) & ~torch.isfinite(after[begin:end])).any():
            return True
    return False
